"""Process plumbing shared by the gateway and workers (torch-free)."""

from __future__ import annotations

import socket

from prometheus_client import CollectorRegistry, start_http_server


def start_metrics_server(registry: CollectorRegistry, host: str, port: int) -> int:
    """Serve /metrics on host:port (0: a free port); returns the port."""
    if port == 0:
        port = free_port(host)
    start_http_server(port, addr=host, registry=registry)
    return port


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
