"""Command-line flags for TLS, API keys and the join secret (docs/security.md), and what they build.

Files and environment variables only: a secret given as a flag value would show in `ps` to every
user of the machine.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from splitserve.common.security import (
    JOIN_SECRET_ENV,
    ClusterSecurity,
    GatewayCredentials,
    TlsIdentity,
    read_secret,
)

API_KEY_ENV = "SPLITSERVE_API_KEY"  # a client's key
DEFAULT_HOSTS = ("localhost", "127.0.0.1")  # the names a `splitserve certs` gateway certificate holds by default


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


def add_gateway_security_args(p: argparse.ArgumentParser) -> None:
    from splitserve.gateway.auth import API_KEYS_ENV

    g = p.add_argument_group("public API security (gateway)")
    g.add_argument("--tls-cert", default=None, help="the public API's certificate (PEM); with --tls-key: TLS")
    g.add_argument("--tls-key", default=None, help="its private key (PEM)")
    g.add_argument("--tls-client-ca", default=None, help="require client certificates signed by this CA (mTLS)")
    g.add_argument(
        "--api-key-file",
        default=None,
        help=f"API keys, one per line, optionally followed by name= rps= burst= concurrency= (or set {API_KEYS_ENV}, "
        "comma-separated); without keys the API is open",
    )
    g.add_argument("--rate-limit-rps", type=float, default=0.0, help="calls per second per key (0: unlimited)")
    g.add_argument("--rate-limit-burst", type=int, default=0, help="calls at once above the rate (0: max(1, rps))")
    g.add_argument("--max-concurrent-per-key", type=int, default=0, help="calls in flight per key (0: unlimited)")
    g.add_argument("--guard-health", action="store_true", help="health checks and reflection need a key too")
    g.add_argument(
        "--max-streams-per-connection", type=int, default=256, help="concurrent gRPC streams per client connection"
    )


def gateway_security_from_args(a: argparse.Namespace):
    from splitserve.gateway.auth import ApiKeys, KeyPolicy
    from splitserve.gateway.server import GatewaySecurity

    if (a.tls_cert is None) != (a.tls_key is None):
        raise ValueError("give --tls-cert and --tls-key together")
    policy = KeyPolicy(rps=a.rate_limit_rps, burst=a.rate_limit_burst, concurrency=a.max_concurrent_per_key)
    return GatewaySecurity(
        cluster=cluster_from_args(a),
        tls=TlsIdentity.load(a.tls_cert, a.tls_key) if a.tls_cert and a.tls_key else None,
        client_ca_pem=Path(a.tls_client_ca).read_bytes() if a.tls_client_ca else None,
        api_keys=ApiKeys.load(a.api_key_file, policy),
        guard_open_services=a.guard_health,
    )


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


def add_certs_args(p: argparse.ArgumentParser) -> None:
    """The flags of `splitserve certs` (services/launcher/certs.py; here because that module needs cryptography)."""
    p.add_argument("--out", required=True, type=Path, help="folder for the bundle (made 0700)")
    hosts = f"a name or IP clients and workers dial the gateway by (repeatable; default: {' '.join(DEFAULT_HOSTS)})"
    p.add_argument("--host", action="append", dest="hosts", help=hosts)
    p.add_argument("--overwrite", action="store_true", help="replace a complete bundle already in --out")
