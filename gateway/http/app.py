"""The HTTP API's routes (docs/openai.md), on the gateway's GenerationCore.

  POST /v1/completions, /v1/chat/completions   OpenAI's, streamed (server-sent events) or not
  GET  /v1/models[/{model}]                    the served model
  POST /tokenize, /detokenize                  vLLM's shapes
  GET  /health (the process is up), /ready (a worker can serve: 200, else 503), /metrics

API keys are the gRPC API's (one PublicAccess, so a key's limits count generations on both APIs):
every route needs one when keys are configured, except /health, /ready and /metrics unless
--guard-health. Every error has OpenAI's shape (errors.py). Every answer carries X-Request-Id (the
client's, else the response's id); CORS is off unless origins are listed.

The event loop serves every stream, so the work that grows with a body (JSON, reading its fields,
decoding token ids) runs on a thread once the body is big; and each prompt is validated and
tokenized once, whatever its n.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import TypeVar

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from splitserve.common.tracing import context_from_headers
from splitserve.gateway.generation import Abort, Choice, GenerationCore, Refused
from splitserve.gateway.http.access import AccessMiddleware, extend_grant
from splitserve.gateway.http.errors import ApiError, bad_request, invalid_request
from splitserve.gateway.http.fields import Fields
from splitserve.gateway.http.protocol import Bounds, ParsedRequest, Parser, chat_messages, parse_chat, parse_completion
from splitserve.gateway.http.shaping import DONE_EVENT, ResponseShaper, TokenStrings, sse
from splitserve.gateway.http.streams import Indexed, Stream, cancel_on_disconnect, started
from splitserve.gateway.metrics import GatewayMetrics
from splitserve.protos.v1 import generation_pb2 as gen_pb

_PARSE_OFF_LOOP_BYTES = 64 * 1024  # bigger bodies are parsed on a thread (the loop serves every stream)
_REQUEST_ID_CHARS = 64  # of X-Request-Id: the ids made from it stay under the 256 bytes a request_id may have
# A JSON escape of a UTF-16 surrogate: only a body with one can hold a lone surrogate (raw UTF-8 cannot).
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class AppSettings:
    max_body_bytes: int  # a bigger body gets 413 (the gRPC API's message limit)
    guard_open_routes: bool = False  # /health, /ready and /metrics need a key too
    cors_origins: tuple[str, ...] = ()  # browser origins allowed to call the API (CORS); none: CORS off


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
        body = await read_body(request, self.settings.max_body_bytes)
        client_id = request.headers.get("x-request-id")
        bounds = Bounds(self.core.model_name, self.core.max_pending, self.core.max_model_len(), self.core.limits)
        args = (parse, body, bounds, (client_id or "")[:_REQUEST_ID_CHARS] or None)
        parsed = await _off_loop_if_big(body, _parse, *args)
        extend_grant(request.scope, parsed.num_choices)  # the key's limits count generations
        parent = context_from_headers(request.headers)  # a traceparent the client sent: each choice's span's parent
        shared = [self.core.share(r, parsed.n) for r in parsed.requests]
        choices = [Choice(shared[p], request_id, seed) for p, request_id, seed in parsed.choices()]
        stream = await cancel_on_disconnect(
            request.receive, _started([self.core.generate(c, parent=parent) for c in choices])
        )
        if stream is None:  # the client left; nobody reads what is returned
            return Response(status_code=499)
        shaper = ResponseShaper(parsed, self.strings, [s.num_prompt_tokens() for s in shared])
        headers = {"x-request-id": client_id or parsed.response_id}
        if parsed.stream:
            return EventStream(_events(shaper, stream[0]), headers)
        whole = await cancel_on_disconnect(request.receive, _collect(shaper, stream[0]))
        return JSONResponse(whole[0], headers=headers) if whole is not None else Response(status_code=499)

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
        body = await read_body(request, self.settings.max_body_bytes)
        f = Fields(await _off_loop_if_big(body, load_json, body))
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
        body = await read_body(request, self.settings.max_body_bytes)
        return await _off_loop_if_big(body, self._detokenize, body)

    def _detokenize(self, body: bytes) -> Response:
        """Decoding and encoding the answer grow with the ids (a 4 MB body holds a million): on a thread
        for a big body."""
        f = Fields(load_json(body))
        self._check_model(f)
        ids = f.token_ids("tokens")
        vocab_size = self.core.tokenizer.vocab_size
        if ids and max(ids) >= vocab_size:
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


def _parse(parse: Parser, body: bytes, bounds: Bounds, request_id: str | None) -> ParsedRequest:
    return parse(load_json(body), bounds, request_id)


async def _off_loop_if_big(body: bytes, work: Callable[..., T], *args: object) -> T:
    """work(*args) on a thread when body is big (its cost grows with it), else here."""
    if len(body) > _PARSE_OFF_LOOP_BYTES:
        return await asyncio.to_thread(work, *args)
    return work(*args)


def _api_error(e: Abort) -> ApiError:
    """OpenAI's error code for a validator's typed refusal; else the gRPC code's name."""
    invalid = e.invalid_request() if isinstance(e, Refused) else None
    return invalid_request(invalid) if invalid is not None else ApiError.from_grpc(e.code, e.message)


async def _started(streams: list[Stream]) -> AsyncGenerator[Indexed, None]:
    try:
        return await started(streams)
    except Abort as e:
        raise _api_error(e) from None


async def _collect(shaper: ResponseShaper, stream: AsyncGenerator[Indexed, None]) -> dict:
    try:
        async with aclosing(stream):
            async for index, response in stream:
                shaper.add(index, response)
    except Abort as e:
        raise _api_error(e) from None
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
        yield sse(_api_error(e).body())
    else:
        if shaper.parsed.include_usage:
            yield shaper.usage_event()
    yield DONE_EVENT


class EventStream(StreamingResponse):
    """text/event-stream whose events stop, and whose source is closed, when the client disconnects."""

    def __init__(self, events: AsyncIterator[bytes], headers: dict[str, str]) -> None:
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache", **headers})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await cancel_on_disconnect(receive, self._send_all(send))

    async def _send_all(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async with aclosing(self.body_iterator) as events:  # type: ignore[type-var]  # an async generator
            async for event in events:
                await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The body; 413 over max_bytes (checked as it arrives)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise ApiError(413, f"the request body is {declared} bytes; this server takes at most {max_bytes}")
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > max_bytes:
            raise ApiError(413, f"the request body is over {max_bytes} bytes, the most this server takes")
    return bytes(body)


def load_json(body: bytes) -> object:
    """The body as JSON, or 400: not UTF-8 JSON, or a string with a lone UTF-16 surrogate (valid JSON,
    yet not text: nothing downstream can encode it)."""
    try:
        value = json.loads(body.decode())  # strict UTF-8: raw surrogate bytes are refused here
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise bad_request(f"the request body is not valid JSON: {str(e)[:200]}") from None
    if _SURROGATE_ESCAPE.search(body):
        where = lone_surrogate(value)
        if where is not None:
            raise bad_request(
                f"{where or 'the body'} holds a lone UTF-16 surrogate (\\ud800-\\udfff without its pair), "
                "which is not text: send valid Unicode",
                where or None,
            )
    return value


def lone_surrogate(value: object) -> str | None:
    """Where a string (or a key) of the JSON value holds a lone surrogate ("messages[0].content"),
    None if none does. json.loads joins escaped pairs, so any surrogate left is lone."""
    stack: list[tuple[str, object]] = [("", value)]
    while stack:  # no recursion: JSON nests deeper than Python's stack
        where, item = stack.pop()
        if isinstance(item, str) and _SURROGATE.search(item):
            return where
        if isinstance(item, dict):
            for key, child in item.items():
                name = f"{where}.{key}" if where else key
                if _SURROGATE.search(key):
                    return where or "a key"
                stack.append((name, child))
        elif isinstance(item, list):
            stack.extend((f"{where}[{i}]", child) for i, child in enumerate(item) if not isinstance(child, int))
    return None


def build_app(core: GenerationCore, metrics: GatewayMetrics, settings: AppSettings, public=None) -> ASGIApp:
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
        exception_handlers={ApiError: _error_response, HTTPException: _http_error, ClientDisconnect: _client_gone},
    )
    guarded = RequestIdHeader(AccessMiddleware(app, metrics, public, settings.guard_open_routes))
    if not settings.cors_origins:
        return guarded
    # Outside the key check: a browser's preflight carries no key; refusals carry the CORS headers too.
    return CORSMiddleware(
        guarded,
        allow_origins=settings.cors_origins,
        allow_methods=["GET", "POST"],
        allow_headers=["authorization", "content-type", "x-request-id", "traceparent"],
        expose_headers=["x-request-id", "retry-after"],
    )


class RequestIdHeader:
    """Every answer carries the client's X-Request-Id when it sent one (a route may set its own)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        client_id = next((v for k, v in scope.get("headers", ()) if k == b"x-request-id"), None)
        if scope["type"] != "http" or client_id is None:
            await self.app(scope, receive, send)
            return

        async def with_id(message: Message) -> None:
            if message["type"] == "http.response.start" and not any(
                k.lower() == b"x-request-id" for k, _ in message.get("headers", ())
            ):
                message = {**message, "headers": [*message.get("headers", ()), (b"x-request-id", client_id)]}
            await send(message)

        await self.app(scope, receive, with_id)


async def _error_response(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)  # registered for ApiError only
    return Response(exc.json_bytes(), exc.status, exc.headers, media_type="application/json")


async def _client_gone(request: Request, exc: Exception) -> Response:
    """The client left while sending its body (or an idle timeout closed it): nobody reads an answer."""
    return Response(status_code=499)


async def _http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own (unknown route 404, wrong method 405) in OpenAI's shape."""
    assert isinstance(exc, HTTPException)  # registered for HTTPException only
    headers = dict(exc.headers) if exc.headers else None
    error = ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", headers=headers)
    return await _error_response(request, error)
