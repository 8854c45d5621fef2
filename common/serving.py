"""Process plumbing shared by the gateway and workers (torch-free)."""

from __future__ import annotations

import asyncio
import random
import socket
import threading

import uvicorn
from prometheus_client import CollectorRegistry, make_asgi_app

from splitserve.common.http_server import HttpLimits, bind_tcp, limited_config

# Every metric's name starts with it (services/worker/metrics.py says why not `splitserve:`)
METRIC_PREFIX = "splitserve_"
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

# A draining worker's running requests get this long to finish (services/worker/server.py WorkerConfig).
DRAIN_TIMEOUT_S = 30.0


def drain_bound_s(drain_timeout_s: float, kv_lease_s: float, kv_transfer_timeout_s: float) -> float:
    """The longest a worker's drain lasts (services/worker/server.py `_drain`); whoever stops a worker waits
    longer than this before killing it (services/launcher/supervisor.py).

    Running requests get drain_timeout_s. KV the worker holds or awaits gets more, up to what its own
    timeouts already bound: a prefill worker's held blocks are claimed by their send within the lease
    (services/engine/leases.py; else they expire), and a claimed send ends within joining the channel and
    sending (4 transfer timeouts at most: services/disagg/transfer/torch_dist.py); a decode worker's landing
    waits at most 4 transfer timeouts for the prefill worker's first token, then 2 for the transfer
    report (services/disagg/decode.py). kv_lease_s + 6 transfer timeouts covers either."""
    return drain_timeout_s + kv_lease_s + 6 * kv_transfer_timeout_s


class MetricsServer:
    """/metrics on one thread running an event loop (uvicorn with prometheus_client's ASGI app): an idle
    connection costs a socket, not a thread (prometheus_client's own server starts one per connection),
    and clients get the same head limit and timeouts as the gateway's HTTP API."""

    def __init__(self, sock: socket.socket, server: _ReadyServer) -> None:
        self.port = sock.getsockname()[1]
        self._sock, self._server = sock, server
        self._thread = threading.Thread(target=self._run, name=f"metrics-http-{self.port}", daemon=True)

    @classmethod
    def start(cls, registry: CollectorRegistry, sock: socket.socket, limits: HttpLimits) -> MetricsServer:
        config = limited_config(make_asgi_app(registry), limits, timeout_graceful_shutdown=1)
        metrics = cls(sock, _ReadyServer(config))
        metrics._thread.start()
        metrics._server.ready.wait()
        if not metrics._server.started:
            raise RuntimeError(f"the /metrics server on port {metrics.port} did not start (its error is logged)")
        return metrics

    def _run(self) -> None:
        try:
            asyncio.run(self._server.serve(sockets=[self._sock]))
        finally:
            self._server.ready.set()  # also when it could not start: start() is waiting

    def stop(self) -> None:
        self._server.should_exit = True  # its main loop looks every 0.1 s
        self._thread.join()


class _ReadyServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.ready = threading.Event()  # set once serving (or once its thread gave up)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        self.ready.set()


def serve_metrics(registry: CollectorRegistry, host: str, port: int, limits: HttpLimits) -> MetricsServer:
    """Serve /metrics on host:port (0: a free port) until stop() or the process ends."""
    sock = bind_tcp(host, free_port(host) if port == 0 else port)
    sock.listen(128)  # clients can connect from here on, as with prometheus_client's server
    return MetricsServer.start(registry, sock, limits)


def start_metrics_server(registry: CollectorRegistry, host: str, port: int) -> int:
    """Serve /metrics on host:port (0: a free port) for the life of the process; returns the port."""
    return serve_metrics(registry, host, port, HttpLimits()).port


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
