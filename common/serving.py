"""Process plumbing shared by the gateway and workers (torch-free)."""

from __future__ import annotations

import socket

from prometheus_client import CollectorRegistry, start_http_server

# Seconds: every latency histogram of the gateway and the workers (TTFT, TPOT, stages, transfers).
LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)


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
