"""Command-line flags for the cluster's TLS and join secret and for calling a secured gateway
(docs/security.md), and what they build; the gateway's own flags are in gateway/security_args.py.

Files and environment variables only: a secret given as a flag value would show in `ps` to every
user of the machine.
"""

from __future__ import annotations

import argparse

from splitserve.common.security import (
    JOIN_SECRET_ENV,
    ClusterSecurity,
    GatewayCredentials,
    TlsIdentity,
    read_secret,
)

API_KEY_ENV = "SPLITSERVE_API_KEY"  # a client's key


def add_cluster_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("cluster security (gateway <-> workers, worker <-> worker)")
    g.add_argument("--cluster-ca", default=None, help="PEM of the CA that signed every cluster certificate")
    g.add_argument("--cluster-cert", default=None, help="this process's cluster certificate (PEM): mTLS")
    g.add_argument("--cluster-key", default=None, help="its private key (PEM)")
    g.add_argument(
        "--join-secret-file",
        default=None,
        help=f"file holding the cluster's join secret (or set {JOIN_SECRET_ENV}); internal calls without it "
        "are refused with UNAUTHENTICATED",
    )


def cluster_from_args(a: argparse.Namespace) -> ClusterSecurity:
    return ClusterSecurity.from_files(a.cluster_ca, a.cluster_cert, a.cluster_key, a.join_secret_file)


def add_client_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("calling a secured gateway")
    g.add_argument("--tls-ca", default=None, help="verify the gateway's TLS certificate with this CA (PEM)")
    g.add_argument("--api-key-file", default=None, help=f"file holding the API key (or set {API_KEY_ENV})")
    g.add_argument("--tls-client-cert", default=None, help="client certificate (PEM), for a gateway that wants one")
    g.add_argument("--tls-client-key", default=None, help="its private key (PEM)")


def gateway_credentials_from_args(a: argparse.Namespace) -> GatewayCredentials:
    if (a.tls_client_cert is None) != (a.tls_client_key is None):
        raise ValueError("give --tls-client-cert and --tls-client-key together")
    identity = TlsIdentity.load(a.tls_client_cert, a.tls_client_key) if a.tls_client_cert else None
    return GatewayCredentials(a.tls_ca, read_secret(a.api_key_file, API_KEY_ENV), identity)
