"""uvicorn serving the HTTP API on the gateway's event loop, beside the grpc.aio server.

The gateway owns the process's signals (SIGTERM drains both servers), so uvicorn installs none;
its socket is bound here so the port is known (and printed) before the first request. With the
gateway's TLS certificate the API is HTTPS; with --tls-client-ca clients need a certificate. Each
request's head is bounded and each wait for a client timed (HttpLimits) before the app sees it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import uvicorn

from splitserve.common.http_server import HttpLimits, bind_tcp, limited_config
from splitserve.common.security import TlsIdentity
from splitserve.gateway.auth import PublicAccess
from splitserve.gateway.generation import GenerationCore
from splitserve.gateway.http.app import AppSettings, build_app
from splitserve.gateway.metrics import GatewayMetrics

log = logging.getLogger("splitserve.gateway")


@dataclass(frozen=True, slots=True)
class HttpSettings:
    host: str
    port: int  # 0: a free one
    max_body_bytes: int
    guard_open_routes: bool = False  # /health, /ready, /metrics need a key too
    tls: TlsIdentity | None = None  # HTTPS with this certificate; None: plain HTTP
    client_ca_pem: bytes | None = None  # clients need a certificate from this CA (needs tls)
    cors_origins: tuple[str, ...] = ()  # browser origins allowed to call the API (CORS); none: CORS off
    limits: HttpLimits = HttpLimits()  # request head size, head and idle timeouts

    def __post_init__(self) -> None:
        if self.client_ca_pem is not None and self.tls is None:
            raise ValueError("--tls-client-ca needs a server certificate (--tls-cert and --tls-key)")


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # the gateway handles SIGTERM and SIGINT and stops this server itself


class HttpApi:
    def __init__(self, server: uvicorn.Server, task: asyncio.Task, settings: HttpSettings, port: int) -> None:
        self.server, self.task, self.settings, self.port = server, task, settings, port

    @classmethod
    async def start(
        cls, settings: HttpSettings, core: GenerationCore, metrics: GatewayMetrics, public: PublicAccess | None
    ) -> HttpApi:
        app_settings = AppSettings(settings.max_body_bytes, settings.guard_open_routes, settings.cors_origins)
        app = build_app(core, metrics, app_settings, public)
        config = limited_config(
            app,
            settings.limits,
            timeout_graceful_shutdown=2,
            ssl_context_factory=_ssl_factory(settings) if settings.tls else None,
        )
        sock = _bind(settings.host, settings.port)
        server = _Server(config)
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started:  # startup runs in the task: listening once started is set
            if task.done():
                task.result()  # raises why it could not start
                raise RuntimeError("the HTTP server stopped while starting")
            await asyncio.sleep(0.01)
        return cls(server, task, settings, sock.getsockname()[1])

    def describe(self) -> str:
        scheme = "https" if self.settings.tls else "http"
        return f"openai {scheme}://{self.settings.host}:{self.port}/v1"

    async def stop(self, grace_s: float) -> None:
        """Stops accepting, lets streams run for grace_s, then cancels them."""
        self.server.config.timeout_graceful_shutdown = max(1, round(grace_s))
        self.server.should_exit = True
        await self.task


def _bind(host: str, port: int) -> socket.socket:
    sock = bind_tcp(host, port)
    sock.set_inheritable(True)
    return sock


def _ssl_factory(settings: HttpSettings) -> Callable[[uvicorn.Config, Callable[[], ssl.SSLContext]], ssl.SSLContext]:
    def factory(config: uvicorn.Config, default: Callable[[], ssl.SSLContext]) -> ssl.SSLContext:
        return server_ssl_context(settings)

    return factory


def server_ssl_context(settings: HttpSettings) -> ssl.SSLContext:
    """The gateway's certificate (PEM bytes in memory: ssl loads a chain only from files, so they pass
    through a private temporary folder for the moment it reads them) and, with a client CA, mTLS."""
    assert settings.tls is not None  # only called with TLS
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    with tempfile.TemporaryDirectory(prefix="splitserve-tls-") as folder:  # made 0700
        cert, key = Path(folder) / "cert.pem", Path(folder) / "key.pem"
        cert.write_bytes(settings.tls.cert_pem)
        key.touch(mode=0o600)
        key.write_bytes(settings.tls.key_pem)
        context.load_cert_chain(cert, key)
    if settings.client_ca_pem is not None:
        context.load_verify_locations(cadata=settings.client_ca_pem.decode())
        context.verify_mode = ssl.CERT_REQUIRED
    return context
