"""The HTTP API's routes in process, on a real GenerationCore (its validator and the tiny model's
tokenizer) whose planner and proxy are fakes: hostile bodies (huge token-id prompts and stop lists,
lone surrogates), where the work runs (off the event loop), each prompt validated once for its n
choices, a key's limits counted in generations, OpenAI's error codes, and the smaller extras
(continuous usage stats, tools with tool_choice "none", x-request-id, CORS).
"""

from __future__ import annotations

import asyncio
import json
import threading
from contextlib import asynccontextmanager
from types import SimpleNamespace

import httpx
import pytest
from cluster_helpers import write_chat_model

from splitserve.common.tokenizer import load_tokenizer
from splitserve.gateway import validation
from splitserve.gateway.auth import ApiKeys, KeyLimiter, KeyPolicy, PublicAccess
from splitserve.gateway.generation import GenerationCore
from splitserve.gateway.http import app as app_module
from splitserve.gateway.http.app import AppSettings, build_app
from splitserve.gateway.metrics import GatewayMetrics
from splitserve.gateway.validation import RequestLimits, RequestValidator
from splitserve.protos.v1 import generation_pb2 as gen_pb

MODEL = "tiny"
CONTEXT = 256
VOCAB_SIZE = 320  # conftest's tiny models
NUM_TOKENS = 3  # each fake generation's
WAIT_S = 30.0  # an upper bound that only a broken run reaches


class Workers:
    """What the validator reads of the worker set."""

    def max_model_len(self, model: str) -> int:
        return CONTEXT

    def vocab_size(self, model: str) -> int:
        return VOCAB_SIZE


class Planner:
    async def plan(self, prompt, avoid, *, retry, migrated=False):
        return SimpleNamespace(prefill=None)

    def can_serve(self) -> bool:
        return True


class Proxy:
    """Streams NUM_TOKENS tokens for every worker request; records the requests and the key's slots held."""

    def __init__(self) -> None:
        self.requests: list = []
        self.on_stream = lambda: None

    async def stream(self, plan, request, deadline, arrival, first_token_at=None):
        self.requests.append(request)
        self.on_stream()
        for i in range(NUM_TOKENS):
            response = gen_pb.GenerateResponse(request_id=request.request_id, text="x", token_ids=[5])
            if i == NUM_TOKENS - 1:
                response.finish_reason = gen_pb.FINISH_REASON_LENGTH
                response.usage.CopyFrom(
                    gen_pb.Usage(prompt_tokens=len(request.prompt_token_ids), completion_tokens=NUM_TOKENS)
                )
            yield response


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir, tmp_path_factory):
    return load_tokenizer(write_chat_model(tiny_llama_dir, tmp_path_factory.mktemp("app") / "tiny-chat"))


@pytest.fixture
def gateway(tokenizer):
    validator = RequestValidator(RequestLimits(), tokenizer, MODEL, Workers())
    proxy = Proxy()
    core = GenerationCore(256, validator, Planner(), proxy, GatewayMetrics())
    return SimpleNamespace(core=core, proxy=proxy, validator=validator, tokenizer=tokenizer)


@asynccontextmanager
async def client(gateway, public=None, **settings):
    app = build_app(gateway.core, GatewayMetrics(), AppSettings(max_body_bytes=4 << 20, **settings), public)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw", timeout=WAIT_S) as c:
        yield c


def post(gateway, path: str, body: dict, **kwargs) -> httpx.Response:
    """One call; the body is encoded here (json.dumps escapes lone surrogates, as clients do)."""

    async def run():
        async with client(gateway, **kwargs.pop("settings", {})) as c:
            content = json.dumps(body).encode()
            return await c.post(path, content=content, headers={"content-type": "application/json", **kwargs})

    return asyncio.run(run())


def openai_error(response: httpx.Response, status: int = 400) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


# --- item 1: hostile sizes are refused while parsing, before anything is built --------------------------


def _count_validations(monkeypatch) -> list:
    calls: list = []
    real = RequestValidator.worker_request

    async def counted(self, request, request_id):
        calls.append(request)
        return await real(self, request, request_id)

    monkeypatch.setattr(RequestValidator, "worker_request", counted)
    return calls


def test_a_token_id_prompt_over_the_context_is_refused_before_its_choices_are_built(gateway, monkeypatch):
    validations = _count_validations(monkeypatch)
    response = post(gateway, "/v1/completions", {"prompt": [1] * 200_000, "n": 128, "max_tokens": 1})
    error = openai_error(response)
    assert error["code"] == "context_length_exceeded" and error["param"] == "prompt"
    assert "maximum context length is 256 tokens" in error["message"]
    assert validations == [] and gateway.proxy.requests == []


def test_a_stop_list_over_the_limit_is_refused_before_its_choices_are_built(gateway, monkeypatch):
    validations = _count_validations(monkeypatch)
    error = openai_error(post(gateway, "/v1/completions", {"prompt": "hi", "stop": ["s"] * 100_000, "n": 64}))
    assert (error["param"], error["code"]) == ("stop", "array_above_max_length")
    error = openai_error(post(gateway, "/v1/completions", {"prompt": "hi", "stop": ["s" * 2000]}))
    assert (error["param"], error["code"]) == ("stop", "string_above_max_length")
    error = openai_error(post(gateway, "/v1/completions", {"prompt": "hi", "stop_token_ids": [1] * 300}))
    assert (error["param"], error["code"]) == ("stop_token_ids", "array_above_max_length")
    assert validations == []


def test_each_prompt_is_validated_and_tokenized_once_for_its_n_choices(gateway, monkeypatch):
    encoded: list[str] = []
    real = gateway.tokenizer.encode
    monkeypatch.setattr(
        gateway.tokenizer, "encode", lambda text, *a, **kw: encoded.append(text) or real(text, *a, **kw)
    )
    body = {"prompt": ["the quick brown fox", "paged attention"], "n": 3, "seed": 7, "max_tokens": NUM_TOKENS}
    response = post(gateway, "/v1/completions", body)
    assert response.status_code == 200, response.text
    assert sorted(encoded) == ["paged attention", "the quick brown fox"]
    requests = sorted(gateway.proxy.requests, key=lambda r: r.request_id)
    assert [r.params.seed for r in requests] == [7, 8, 9] * 2
    assert len({r.request_id for r in requests}) == 6
    assert [list(r.prompt_token_ids) for r in requests[:3]] == [real("the quick brown fox")] * 3
    assert [c["index"] for c in response.json()["choices"]] == list(range(6))


class Hold:
    """Holds a piece of work (on whatever thread runs it) until /health has answered."""

    def __init__(self) -> None:
        self.started, self.health_answered = threading.Event(), threading.Event()

    def wrap(self, work, what: str):
        def held(*args, **kwargs):
            self.started.set()
            assert self.health_answered.wait(WAIT_S), f"/health got no answer while {what}"
            return work(*args, **kwargs)

        return held


def _health_answers_while(gateway, hold: Hold, path: str, body: dict) -> httpx.Response:
    """Posts body; once the held work has started, GET /health (it must answer before the work goes on).
    On the event loop the held work would block /health until WAIT_S and fail."""

    async def run():
        async with client(gateway) as c:
            content = json.dumps(body).encode()
            call = asyncio.ensure_future(c.post(path, content=content, headers={"content-type": "application/json"}))
            assert await asyncio.to_thread(hold.started.wait, WAIT_S)
            assert (await c.get("/health")).status_code == 200
            hold.health_answered.set()
            return await call

    return asyncio.run(run())


def test_a_big_body_is_parsed_off_the_event_loop(gateway, monkeypatch):
    hold = Hold()
    monkeypatch.setattr(app_module, "parse_completion", hold.wrap(app_module.parse_completion, "parsing the body"))
    response = _health_answers_while(gateway, hold, "/v1/completions", {"prompt": [1] * 100_000})
    assert openai_error(response)["code"] == "context_length_exceeded"


def test_detokenize_of_many_ids_runs_off_the_event_loop(gateway, monkeypatch):
    hold = Hold()
    monkeypatch.setattr(gateway.tokenizer, "decode", hold.wrap(gateway.tokenizer.decode, "decoding the ids"))
    response = _health_answers_while(gateway, hold, "/detokenize", {"tokens": [65] * 100_000})
    assert response.status_code == 200 and len(response.json()["prompt"]) >= 100_000


# --- item 7: lone surrogates ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {"prompt": "a\ud800b"}, "prompt"),
        ("/v1/completions", {"prompt": ["ok", "\udfff"]}, "prompt"),
        ("/v1/completions", {"prompt": "a", "stop": ["\ud800"]}, "stop"),
        ("/v1/completions", {"prompt": "a", "stop": "\ud800"}, "stop"),
        ("/v1/completions", {"prompt": "a", "user": "\ud800"}, "user"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]}, "messages[0].content"),
        ("/v1/chat/completions", {"messages": [{"role": "us\udc00er", "content": "a"}]}, "messages[0].role"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]},
            "messages[0].content[0].text",
        ),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "stop": ["\ud800"]}, "stop"),
        ("/tokenize", {"prompt": "\ud800"}, "prompt"),
        ("/tokenize", {"messages": [{"role": "user", "content": "x\ud800"}]}, "messages[0].content"),
    ],
)
def test_lone_surrogates_are_openai_shaped_400s(gateway, path, body, param):
    error = openai_error(post(gateway, path, body))
    assert error["type"] == "invalid_request_error" and error["param"].startswith(param)
    assert "surrogate" in error["message"]


def test_a_surrogate_pair_is_one_character(gateway):
    response = post(gateway, "/tokenize", {"prompt": "\U0001f642"})  # json.dumps sends "\ud83d\ude42"
    assert response.status_code == 200 and response.json()["count"] > 0


# --- item 12: OpenAI's error codes, from the validator's typed errors ------------------------------------


def test_a_text_prompt_over_the_context_is_context_length_exceeded(gateway):
    error = openai_error(post(gateway, "/v1/completions", {"prompt": "the quick brown fox " * 200}))
    assert error["code"] == "context_length_exceeded"
    assert error["message"].startswith("This model's maximum context length is 256 tokens. However, you requested")
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 300}
    assert openai_error(post(gateway, "/v1/chat/completions", chat))["code"] == "context_length_exceeded"


def test_validation_errors_are_typed():
    limits = RequestLimits()
    with pytest.raises(validation.ContextLengthExceeded):
        validation.check_fits_context(200, 100, CONTEXT)
    with pytest.raises(validation.TooLong):
        validation.check_prompt_size(gen_pb.GenerateRequest(text="x" * (limits.max_prompt_bytes + 1)), limits)
    with pytest.raises(validation.TooMany):
        validation.check_stop_sizes(gen_pb.StoppingCriteria(stop=["s"] * 300), limits)
    assert issubclass(validation.InvalidRequest, ValueError)


# --- item 11: continuous usage stats ---------------------------------------------------------------------


def _events(response: httpx.Response) -> list[dict]:
    lines = [line for line in response.text.split("\n\n") if line]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


def test_continuous_usage_stats_put_the_running_usage_on_every_chunk(gateway):
    options = {"include_usage": True, "continuous_usage_stats": True}
    body = {"prompt": [1, 2, 3, 4], "n": 2, "stream": True, "stream_options": options, "max_tokens": NUM_TOKENS}
    events = _events(post(gateway, "/v1/completions", body))
    chunks, last = events[:-1], events[-1]
    assert len(chunks) == 2 * NUM_TOKENS and all(c["usage"]["prompt_tokens"] == 4 for c in chunks)
    for index in (0, 1):
        counts = [c["usage"]["completion_tokens"] for c in chunks if c["choices"][0]["index"] == index]
        assert counts == [1, 2, 3]
    assert all(c["usage"]["total_tokens"] == 4 + c["usage"]["completion_tokens"] for c in chunks)
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 2 * NUM_TOKENS
    chat = {"messages": [{"role": "user", "content": "hi"}], "stream": True, "stream_options": options}
    opening, first = _events(post(gateway, "/v1/chat/completions", {**chat, "max_tokens": 2}))[:2]
    assert opening["usage"]["completion_tokens"] == 0 and first["usage"]["completion_tokens"] == 1
    assert opening["usage"]["prompt_tokens"] == first["usage"]["prompt_tokens"] > 0


# --- item 14: tools with tool_choice "none", x-request-id, CORS ------------------------------------------


def test_tools_are_accepted_and_ignored_with_tool_choice_none(gateway):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    chat = {"messages": [{"role": "user", "content": "hi"}], "tools": tools, "max_tokens": 2}
    assert post(gateway, "/v1/chat/completions", {**chat, "tool_choice": "none"}).status_code == 200
    error = openai_error(post(gateway, "/v1/chat/completions", chat))
    assert error["param"] == "tools"  # with tool_choice left out (auto) the tools would be called: refused


def test_x_request_id_header_is_the_clients_or_the_response_id(gateway):
    response = post(gateway, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert response.headers["x-request-id"] == response.json()["id"]
    response = post(gateway, "/v1/completions", {"prompt": "hi", "max_tokens": 2}, **{"x-request-id": "abc"})
    assert response.headers["x-request-id"] == "abc" and response.json()["id"] == "cmpl-abc"
    error = post(gateway, "/v1/completions", {"prompt": []}, **{"x-request-id": "bad-1"})
    assert error.status_code == 400 and error.headers["x-request-id"] == "bad-1"


def test_cors_is_off_by_default_and_allows_the_listed_origins(gateway):
    async def run(origins: tuple[str, ...]):
        async with client(gateway, cors_origins=origins) as c:
            preflight = await c.options(
                "/v1/completions",
                headers={
                    "origin": "https://app.example",
                    "access-control-request-method": "POST",
                    "access-control-request-headers": "authorization, content-type",
                },
            )
            simple = await c.get("/v1/models", headers={"origin": "https://app.example"})
            return preflight, simple

    preflight, simple = asyncio.run(run(()))
    assert "access-control-allow-origin" not in simple.headers and preflight.status_code == 405
    preflight, simple = asyncio.run(run(("https://app.example",)))
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == "https://app.example"
    assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
    assert simple.headers["access-control-allow-origin"] == "https://app.example"
    _, other = asyncio.run(run(("https://other.example",)))
    assert "access-control-allow-origin" not in other.headers


# --- item 4: a key's limits count generations ------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _keyed(tmp_path, line: str) -> tuple[PublicAccess, KeyPolicy]:
    path = tmp_path / "keys"
    path.write_text(f"sk-1 name=k {line}\n")
    keys = ApiKeys.load(str(path))
    policy = keys.lookup((("authorization", "Bearer sk-1"),))
    return PublicAccess(keys, KeyLimiter(Clock())), policy


def _keyed_post(gateway, public: PublicAccess, body: dict) -> httpx.Response:
    async def run():
        async with client(gateway, public) as c:
            return await c.post("/v1/completions", json=body, headers={"authorization": "Bearer sk-1"})

    return asyncio.run(run())


def test_a_call_holds_one_concurrency_slot_per_generation(gateway, tmp_path):
    public, policy = _keyed(tmp_path, "concurrency=4")
    held: list[int] = []
    gateway.proxy.on_stream = lambda: held.append(public.limiter.in_flight("k"))
    assert _keyed_post(gateway, public, {"prompt": ["a", "b"], "n": 2, "max_tokens": 2}).status_code == 200
    assert held == [4] * 4 and public.limiter.in_flight("k") == 0
    for _ in range(2):  # two other calls in flight: 3 more generations could fit later
        assert public.limiter.try_acquire(policy) is None
    response = _keyed_post(gateway, public, {"prompt": "a", "n": 3, "max_tokens": 2})
    error = openai_error(response, 429)
    assert error["code"] == "rate_limit_exceeded" and int(response.headers["retry-after"]) >= 1
    assert public.limiter.in_flight("k") == 2


def test_a_call_whose_generations_never_fit_the_key_is_400(gateway, tmp_path):
    public, _ = _keyed(tmp_path, "concurrency=2")
    error = openai_error(_keyed_post(gateway, public, {"prompt": "a", "n": 3}))
    assert error["param"] == "n" and "concurrency=2" in error["message"]
    public, _ = _keyed(tmp_path, "rps=1 burst=2")
    error = openai_error(_keyed_post(gateway, public, {"prompt": ["a", "b", "c"]}))
    assert error["param"] == "n" and "burst=2" in error["message"]
    assert public.limiter.in_flight("k") == 0


def test_a_call_spends_one_rate_token_per_generation(gateway, tmp_path):
    public, _ = _keyed(tmp_path, "rps=1 burst=3")
    assert _keyed_post(gateway, public, {"prompt": "a", "n": 2, "max_tokens": 2}).status_code == 200
    response = _keyed_post(gateway, public, {"prompt": "a", "n": 2, "max_tokens": 2})  # one token left
    assert openai_error(response, 429)["code"] == "rate_limit_exceeded"
    public.limiter.clock.now += 1.0  # one more token: two now
    assert _keyed_post(gateway, public, {"prompt": "a", "n": 2, "max_tokens": 2}).status_code == 200


def test_the_extra_slots_are_released_when_the_call_fails(gateway, tmp_path):
    public, _ = _keyed(tmp_path, "concurrency=4")
    error = openai_error(_keyed_post(gateway, public, {"prompt": "the quick brown fox " * 200, "n": 3}))
    assert error["code"] == "context_length_exceeded" and public.limiter.in_flight("k") == 0


# --- a client that leaves in the middle of its body ------------------------------------------------------


def test_a_client_gone_mid_body_ends_the_call_quietly(gateway):
    """The body's stream raises starlette's ClientDisconnect; it used to escape the app, and uvicorn logged
    "Exception in ASGI application" with a traceback for every such client (one an idle timeout closes too)."""
    app = build_app(gateway.core, GatewayMetrics(), AppSettings(max_body_bytes=4 << 20))
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"content-length", b"100")],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 2),
    }
    messages = iter([{"type": "http.request", "body": b'{"prompt": "hi', "more_body": True}])
    sent: list = []

    async def receive():
        return next(messages, {"type": "http.disconnect"})

    async def send(message):
        sent.append(message)

    asyncio.run(app(scope, receive, send))  # raised ClientDisconnect before
    assert gateway.proxy.requests == []


@pytest.mark.parametrize(
    ("field", "value", "code"),
    [
        ("temperature", -1.0, "decimal_below_min_value"),
        ("top_p", 2.0, "decimal_above_max_value"),
        ("presence_penalty", -3.0, "decimal_below_min_value"),
        ("frequency_penalty", 2.5, "decimal_above_max_value"),
        ("min_p", 1.5, "decimal_above_max_value"),
    ],
)
def test_a_sampling_value_out_of_range_names_its_field_and_openai_s_code(gateway, field, value, code):
    body = {"prompt": "hello", "max_tokens": 2, field: value}
    error = openai_error(post(gateway, "/v1/completions", body))
    assert (error["param"], error["code"]) == (field, code)
    assert field in error["message"] and gateway.proxy.requests == []
