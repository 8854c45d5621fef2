"""The HTTP API's routes (docs/openai.md), on the gateway's GenerationCore.

  POST /v1/completions, /v1/chat/completions   OpenAI's, streamed (server-sent events) or not
  GET  /v1/models[/{model}]                    the served model
  POST /tokenize, /detokenize                  vLLM's shapes
  GET  /health (the process is up), /ready (a worker can serve: 200, else 503), /metrics

API keys are the gRPC API's (one PublicAccess, so a key's limits count calls on both APIs):
every route needs one when keys are configured, except /health, /ready and /metrics unless
--guard-health. Every error has OpenAI's shape (errors.py).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from splitserve.common.tracing import context_from_headers
from splitserve.gateway.generation import Abort, GenerationCore
from splitserve.gateway.http.access import AccessMiddleware
from splitserve.gateway.http.errors import ApiError, bad_request
from splitserve.gateway.http.fields import Fields
from splitserve.gateway.http.protocol import ParsedRequest, chat_messages, parse_chat, parse_completion
from splitserve.gateway.http.shaping import DONE_EVENT, ResponseShaper, TokenStrings, sse
from splitserve.gateway.http.streams import Indexed, Stream, cancel_on_disconnect, started
from splitserve.gateway.metrics import GatewayMetrics
from splitserve.protos.v1 import generation_pb2 as gen_pb

_PARSE_OFF_LOOP_BYTES = 64 * 1024  # bigger bodies are parsed on a thread (the loop serves every stream)
_REQUEST_ID_CHARS = 64  # of X-Request-Id: the ids made from it stay under the 256 bytes a request_id may have
Parser = Callable[[object, str, int, str | None], ParsedRequest]


@dataclass(frozen=True, slots=True)
class AppSettings:
    max_body_bytes: int  # a bigger body gets 413 (the gRPC API's message limit)
    guard_open_routes: bool = False  # /health, /ready and /metrics need a key too


class OpenAIRoutes:
    """The endpoints; one instance per gateway."""

    def __init__(self, core: GenerationCore, metrics: GatewayMetrics, settings: AppSettings) -> None:
        self.core, self.metrics, self.settings = core, metrics, settings
        self.strings = TokenStrings(core.tokenizer)
        self.created = int(time.time())

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, parse_completion)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, parse_chat)

    async def _generate(self, request: Request, parse: Parser) -> Response:
        body = await read_json(request, self.settings.max_body_bytes)
        request_id = request.headers.get("x-request-id", "")[:_REQUEST_ID_CHARS] or None
        parsed = parse(body, self.core.model_name, self.core.max_pending, request_id)
        parent = context_from_headers(request.headers)  # a traceparent the client sent: each choice's span's parent
        streams = [self.core.generate(r, parent=parent) for r in parsed.requests]
        stream = await cancel_on_disconnect(request.receive, _started(streams))
        if stream is None:  # the client left; nobody reads what is returned
            return Response(status_code=499)
        shaper = ResponseShaper(parsed, self.strings)
        if parsed.stream:
            return EventStream(_events(shaper, stream[0]))
        whole = await cancel_on_disconnect(request.receive, _collect(shaper, stream[0]))
        return JSONResponse(whole[0]) if whole is not None else Response(status_code=499)

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._card()]})

    async def model(self, request: Request) -> Response:
        if request.path_params["model"] != self.core.model_name:
            raise ApiError(
                404,
                f"the model {request.path_params['model'][:64]!r} does not exist",
                param="model",
                code="model_not_found",
            )
        return JSONResponse(self._card())

    def _card(self) -> dict:
        name = self.core.model_name
        return {
            "id": name,
            "object": "model",
            "created": self.created,
            "owned_by": "splitserve",
            "root": name,
            "parent": None,
            "max_model_len": self.core.max_model_len() or None,  # None until a worker has registered
        }

    async def tokenize(self, request: Request) -> Response:
        f = Fields(await read_json(request, self.settings.max_body_bytes))
        self._check_model(f)
        if f.get("messages") is not None:
            tokenize = gen_pb.TokenizeRequest(chat=chat_messages(f.get("messages")))
            add_special = f.boolean("add_special_tokens", False)
        else:
            tokenize = gen_pb.TokenizeRequest(text=f.string("prompt", None) or "")
            add_special = f.boolean("add_special_tokens", True)
        try:
            ids = await self.core.tokenize(tokenize, add_special)
        except ValueError as e:
            raise bad_request(str(e)) from None
        strings = [self.strings(t) for t in ids] if f.boolean("return_token_strs", False) else None
        return JSONResponse(
            {"count": len(ids), "max_model_len": self.core.max_model_len(), "tokens": ids, "token_strs": strings}
        )

    async def detokenize(self, request: Request) -> Response:
        f = Fields(await read_json(request, self.settings.max_body_bytes))
        self._check_model(f)
        ids = f.token_ids("tokens")
        vocab_size = self.core.tokenizer.vocab_size
        if any(t >= vocab_size for t in ids):
            raise bad_request(f"tokens must be in [0, {vocab_size}) (the tokenizer's vocabulary)", "tokens")
        return JSONResponse({"prompt": self.core.tokenizer.decode(list(ids))})

    def _check_model(self, f: Fields) -> None:
        model = f.string("model", None)
        if model is not None and model != self.core.model_name:
            raise ApiError(404, f"the model {model[:64]!r} does not exist", param="model", code="model_not_found")

    async def health(self, request: Request) -> Response:
        return Response(status_code=200)

    async def ready(self, request: Request) -> Response:
        if not self.core.can_serve():
            raise ApiError(503, "no healthy worker can serve the model yet", code="unavailable")
        return JSONResponse({"ready": True, "model": self.core.model_name})

    async def prometheus(self, request: Request) -> Response:
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)


async def _started(streams: list[Stream]) -> AsyncGenerator[Indexed, None]:
    try:
        return await started(streams)
    except Abort as e:
        raise ApiError.from_grpc(e.code, e.message) from None


async def _collect(shaper: ResponseShaper, stream: AsyncGenerator[Indexed, None]) -> dict:
    try:
        async with aclosing(stream):
            async for index, response in stream:
                shaper.add(index, response)
    except Abort as e:
        raise ApiError.from_grpc(e.code, e.message) from None
    return shaper.body()


async def _events(shaper: ResponseShaper, stream: AsyncGenerator[Indexed, None]) -> AsyncGenerator[bytes, None]:
    """The server-sent events of a streamed answer; an error after the headers went out is an event."""
    for opening in shaper.opening_events():
        yield opening
    try:
        async with aclosing(stream):
            async for index, response in stream:
                event = shaper.event(index, response)
                if event is not None:
                    yield event
    except Abort as e:
        yield sse(ApiError.from_grpc(e.code, e.message).body())
    else:
        if shaper.parsed.include_usage:
            yield shaper.usage_event()
    yield DONE_EVENT


class EventStream(StreamingResponse):
    """text/event-stream whose events stop, and whose source is closed, when the client disconnects."""

    def __init__(self, events: AsyncIterator[bytes]) -> None:
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await cancel_on_disconnect(receive, self._send_all(send))

    async def _send_all(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async with aclosing(self.body_iterator) as events:  # type: ignore[type-var]  # an async generator
            async for event in events:
                await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def read_json(request: Request, max_bytes: int) -> object:
    """The body as JSON; 413 over max_bytes (checked as it arrives), 400 if it is not JSON."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise ApiError(413, f"the request body is {declared} bytes; this server takes at most {max_bytes}")
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > max_bytes:
            raise ApiError(413, f"the request body is over {max_bytes} bytes, the most this server takes")
    try:
        if len(body) > _PARSE_OFF_LOOP_BYTES:
            return await asyncio.to_thread(json.loads, bytes(body))
        return json.loads(body)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise bad_request(f"the request body is not valid JSON: {str(e)[:200]}") from None


def build_app(core: GenerationCore, metrics: GatewayMetrics, settings: AppSettings, public=None) -> AccessMiddleware:
    routes = OpenAIRoutes(core, metrics, settings)
    app = Starlette(
        routes=[
            Route("/v1/completions", routes.completions, methods=["POST"]),
            Route("/v1/chat/completions", routes.chat_completions, methods=["POST"]),
            Route("/v1/models", routes.models, methods=["GET"]),
            Route("/v1/models/{model:path}", routes.model, methods=["GET"]),
            Route("/tokenize", routes.tokenize, methods=["POST"]),
            Route("/detokenize", routes.detokenize, methods=["POST"]),
            Route("/health", routes.health, methods=["GET"]),
            Route("/ready", routes.ready, methods=["GET"]),
            Route("/metrics", routes.prometheus, methods=["GET"]),
        ],
        exception_handlers={ApiError: _api_error, HTTPException: _http_error},
    )
    return AccessMiddleware(app, metrics, public, settings.guard_open_routes)


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)  # registered for ApiError only
    return Response(exc.json_bytes(), exc.status, exc.headers, media_type="application/json")


async def _http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own (unknown route 404, wrong method 405) in OpenAI's shape."""
    assert isinstance(exc, HTTPException)  # registered for HTTPException only
    headers = dict(exc.headers) if exc.headers else None
    error = ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", headers=headers)
    return await _api_error(request, error)
