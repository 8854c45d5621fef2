"""Process plumbing shared by the gateway and workers (torch-free)."""

from __future__ import annotations

import random
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

# A draining worker's running requests get this long to finish (worker/server.py WorkerConfig).
DRAIN_TIMEOUT_S = 30.0


def drain_bound_s(drain_timeout_s: float, kv_lease_s: float, kv_transfer_timeout_s: float) -> float:
    """The longest a worker's drain lasts (worker/server.py `_drain`); whoever stops a worker waits
    longer than this before killing it (launch/supervisor.py).

    Running requests get drain_timeout_s. KV the worker holds or awaits gets more, up to what its own
    timeouts already bound: a prefill worker's held blocks are claimed by their send within the lease
    (engine/leases.py; else they expire), and a claimed send ends within joining the channel and
    sending (4 transfer timeouts at most: disagg/transfer/torch_dist.py); a decode worker's landing
    waits at most 4 transfer timeouts for the prefill worker's first token, then 2 for the transfer
    report (disagg/decode.py). kv_lease_s + 6 transfer timeouts covers either."""
    return drain_timeout_s + kv_lease_s + 6 * kv_transfer_timeout_s


def start_metrics_server(registry: CollectorRegistry, host: str, port: int) -> int:
    """Serve /metrics on host:port (0: a free port); returns the port."""
    if port == 0:
        port = free_port(host)
    start_http_server(port, addr=host, registry=registry)
    return port


_LOWEST_PORT = 10_000  # free_port's ports: from here to just below the kernel's ephemeral range


def ephemeral_port_range() -> tuple[int, int]:
    """The ports the kernel hands out for port 0 and outgoing connections (Linux's default elsewhere)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def free_port(host: str = "127.0.0.1") -> int:
    """A port that is free now and that the kernel will not give anyone else meanwhile: chosen at random
    below its ephemeral range. A port from bind(0) is ephemeral, and a child process binding it seconds
    later could find it taken by any outgoing connection (CI saw a worker's metrics port go that way)."""
    low, high = ephemeral_port_range()
    bottom, top = (_LOWEST_PORT, low - 1) if low > _LOWEST_PORT + 1000 else (high + 1, 65535)
    if top - bottom < 1000:  # the kernel's range covers (nearly) every port: take one from it
        with socket.socket() as s:
            s.bind((host, 0))
            return s.getsockname()[1]
    for _ in range(100):
        port = random.randint(bottom, top)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise OSError(f"no free port in {bottom}-{top} on {host}")
