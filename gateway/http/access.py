"""API keys and the per-route counter, as one ASGI middleware around the app.

The key check is the gRPC API's PublicAccess (gateway/auth.py), the same instance: a key's rate
and concurrency limits count its calls on both APIs, and a call holds its concurrency slot until
its answer (a whole stream) has gone out.
"""

from __future__ import annotations

from http import HTTPStatus

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from splitserve.common.security import Metadata
from splitserve.gateway.auth import PublicAccess
from splitserve.gateway.http.errors import ApiError
from splitserve.gateway.metrics import GatewayMetrics

OPEN_ROUTES = frozenset({"/health", "/ready", "/metrics"})  # like gRPC health: no key unless --guard-health
_DENIAL_CODES = {HTTPStatus.UNAUTHORIZED: "invalid_api_key", HTTPStatus.TOO_MANY_REQUESTS: "rate_limit_exceeded"}


class AccessMiddleware:
    def __init__(
        self, app: ASGIApp, metrics: GatewayMetrics, public: PublicAccess | None, guard_open_routes: bool
    ) -> None:
        self.app, self.metrics, self.public, self.guard_open = app, metrics, public, guard_open_routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":  # lifespan
            await self.app(scope, receive, send)
            return
        path = scope["path"]

        async def counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.count_http(path, message["status"])
            await send(message)

        if self.public is None or (path in OPEN_ROUTES and not self.guard_open):
            await self.app(scope, receive, counted)
            return
        admission = await self.public(_metadata(scope))
        if admission.denial is not None:
            code, message = admission.denial
            self.metrics.count_denial("public", code)
            # the trailing metadata (retry-after) holds HTTP header names
            error = ApiError.from_grpc(code, message, headers={k.title(): v for k, v in admission.trailing})
            error.code = _DENIAL_CODES.get(error.status, error.code)
            await _send_error(error, counted)
            return
        try:
            await self.app(scope, receive, counted)
        finally:
            if admission.release is not None:
                admission.release()


def _metadata(scope: Scope) -> Metadata:
    """The headers ApiKeys reads (as gRPC metadata: lower-case names)."""
    for name, value in scope["headers"]:
        if name == b"authorization":
            return (("authorization", value.decode("latin-1")),)
    return ()


async def _send_error(error: ApiError, send: Send) -> None:
    body = error.json_bytes()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in error.headers.items()]
    await send({"type": "http.response.start", "status": int(error.status), "headers": headers})
    await send({"type": "http.response.body", "body": body})
