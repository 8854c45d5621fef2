"""API keys and the per-route counter, as one ASGI middleware around the app.

The key check is the gRPC API's PublicAccess, the same instance: a key's rate and concurrency
limits count its generations on both APIs. A call is admitted with one generation's slot and rate
token; the routes that run more (prompts x n) extend its grant (scope[KEY_GRANT]) once the body is
read. The call holds its slots until its answer (a whole stream) has gone out or failed.
"""

from __future__ import annotations

from http import HTTPStatus

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from splitserve.common.security import Metadata
from splitserve.gateway.auth import KeyDenied, KeyGrant, PublicAccess
from splitserve.gateway.http.errors import ApiError
from splitserve.gateway.metrics import GatewayMetrics

OPEN_ROUTES = frozenset({"/health", "/ready", "/metrics"})  # like gRPC health: no key unless --guard-health
_DENIAL_CODES = {HTTPStatus.UNAUTHORIZED: "invalid_api_key", HTTPStatus.TOO_MANY_REQUESTS: "rate_limit_exceeded"}
KEY_GRANT = "splitserve.key_grant"  # the scope's KeyGrant of a call admitted by its key (absent without keys)


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
        try:
            grant = self.public.admit(_metadata(scope))
        except KeyDenied as e:
            self.metrics.count_denial("public", e.code)
            await _send_error(denied(e), counted)
            return
        try:
            await self.app({**scope, KEY_GRANT: grant}, receive, counted)
        finally:
            grant.release()


def extend_grant(scope: Scope, num_generations: int) -> None:
    """The call's key holds num_generations slots and tokens from now on, or ApiError (400 if they could
    never fit its limits, else 429 with Retry-After). No key configured: nothing to count."""
    grant: KeyGrant | None = scope.get(KEY_GRANT)
    if grant is None:
        return
    try:
        grant.extend_to(num_generations)
    except KeyDenied as e:
        error = denied(e)
        error.param = "n" if error.status == HTTPStatus.BAD_REQUEST else None
        raise error from None


def denied(e: KeyDenied) -> ApiError:
    # the trailing metadata (retry-after) holds HTTP header names
    error = ApiError.from_grpc(e.code, e.message, headers={k.title(): v for k, v in e.trailing})
    error.code = _DENIAL_CODES.get(error.status, error.code)
    return error


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
