"""The gateway's public-API security flags (TLS, API keys, rate limits; docs/security.md) and the
GatewaySecurity they build."""

from __future__ import annotations

import argparse
from pathlib import Path

from splitserve.common.security import TlsIdentity
from splitserve.common.security_args import cluster_from_args


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
