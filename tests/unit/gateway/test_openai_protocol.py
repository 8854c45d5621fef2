"""The HTTP API's request parsing, answer shaping and stream merging, in process (no servers)."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from splitserve.gateway.http.errors import ApiError
from splitserve.gateway.http.protocol import Bounds, parse_chat, parse_completion
from splitserve.gateway.http.shaping import DONE_EVENT, ResponseShaper, TokenStrings
from splitserve.gateway.http.streams import cancel_on_disconnect, merge, started
from splitserve.gateway.proxy import Abort
from splitserve.protos.v1 import generation_pb2 as pb

MODEL = "m"
BOUNDS = Bounds(MODEL, 16, 256)


def completion(**body):
    return parse_completion({"model": MODEL, **body}, BOUNDS, None)


def chat(**body):
    return parse_chat({"messages": [{"role": "user", "content": "hi"}], **body}, BOUNDS, None)


def refused(parse, status: int = 400, **body) -> ApiError:
    with pytest.raises(ApiError) as err:
        parse(**body)
    assert err.value.status == status
    return err.value


@pytest.mark.parametrize(
    "prompt, expected",
    [
        ("hello", [("text", "hello")]),
        (["a", "b"], [("text", "a"), ("text", "b")]),
        ([1, 2, 3], [("token_ids", [1, 2, 3])]),
        ([[1, 2], [3]], [("token_ids", [1, 2]), ("token_ids", [3])]),
    ],
)
def test_completion_prompt_forms(prompt, expected):
    requests = completion(prompt=prompt).requests
    kinds = [(r.WhichOneof("prompt"), r.text if r.HasField("text") else list(r.token_ids.ids)) for r in requests]
    assert kinds == expected


def test_n_fans_out_with_seed_plus_sample_index_sharing_one_request_per_prompt():
    parsed = completion(prompt=["a", "b"], n=3, seed=-1, temperature=0.5, max_tokens=7)
    choices = list(parsed.choices())
    assert [seed for _, _, seed in choices] == [2**64 - 1, 0, 1] * 2
    assert [parsed.requests[p].text for p, _, _ in choices] == ["a"] * 3 + ["b"] * 3
    assert len({request_id for _, request_id, _ in choices}) == 6 == parsed.num_choices
    assert len(parsed.requests) == 2
    assert all(r.sampling.temperature == 0.5 and r.stopping.max_tokens == 7 for r in parsed.requests)
    assert all(not r.sampling.HasField("seed") for r in parsed.requests)  # each choice's is set on its copy
    assert [seed for _, _, seed in completion(prompt="a", n=2).choices()] == [None, None]


def test_defaults_and_vllm_extras():
    r = completion(prompt="a").requests[0]
    assert r.stopping.max_tokens == 16 and not r.sampling.HasField("temperature") and not r.HasField("logprobs")
    assert not completion(prompt="a", max_tokens=None).requests[0].stopping.HasField("max_tokens")
    extras = dict(top_k=-1, min_p=0.1, repetition_penalty=1.1, min_tokens=2, ignore_eos=True, stop_token_ids=[5])
    r = completion(prompt="a", stop="x", logprobs=3, priority=-2, **extras).requests[0]
    assert (r.sampling.top_k, r.sampling.repetition_penalty, r.stopping.min_tokens) == (0, pytest.approx(1.1), 2)
    assert (list(r.stopping.stop), list(r.stopping.stop_token_ids), r.stopping.ignore_eos) == (["x"], [5], True)
    assert (r.logprobs, r.priority) == (3, -2)


def test_chat_fields():
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    parsed = parse_chat(
        {"messages": [{"role": "user", "content": parts}], "max_tokens": 3, "max_completion_tokens": 5},
        BOUNDS,
        "abc",
    )
    r = parsed.requests[0]
    assert r.chat.messages[0].content == "a\nb" and r.stopping.max_tokens == 5
    assert parsed.response_id == "chatcmpl-abc" and next(parsed.choices())[1] == "chatcmpl-abc-0"
    assert not chat().requests[0].stopping.HasField("max_tokens")  # a chat fills the context by default
    assert chat(logprobs=True, top_logprobs=4).requests[0].logprobs == 4
    assert chat(logprobs=True).logprobs == 0 and chat().logprobs is None


@pytest.mark.parametrize(
    "parse, body, param",
    [
        (completion, {"prompt": []}, "prompt"),
        (completion, {"prompt": [1, -2]}, "prompt"),
        (completion, {"prompt": "a", "n": 0}, "n"),
        (completion, {"prompt": ["a"] * 9, "n": 2}, "n"),  # 18 generations > 16
        (completion, {"prompt": "a", "max_tokens": "9"}, "max_tokens"),
        (completion, {"prompt": "a", "temperature": True}, "temperature"),
        (completion, {"prompt": "a", "logprobs": 21}, "logprobs"),
        (completion, {"prompt": "a", "echo": True, "logprobs": 1}, "echo"),
        (completion, {"prompt": "a", "logit_bias": {"5": 1}}, "logit_bias"),
        (completion, {"prompt": "a", "suffix": "z"}, "suffix"),
        (completion, {"prompt": "a", "best_of": 3}, "best_of"),
        (completion, {"prompt": "a", "stream_options": {"include_usage": True}}, "stream_options"),
        (completion, {"prompt": [1] * 256}, "prompt"),  # the context, counted before the ids are read
        (completion, {"prompt": [[1], [1] * 300]}, "prompt"),
        (completion, {"prompt": ["a"] * 17}, "prompt"),  # more prompts than generations, before reading them
        (completion, {"prompt": "a", "stop": ["s"] * 257}, "stop"),
        (completion, {"prompt": "a", "stop": "s" * 1025}, "stop"),
        (completion, {"prompt": "a", "stop_token_ids": [1] * 257}, "stop_token_ids"),
        (chat, {"tools": [{"type": "function"}], "tool_choice": "auto"}, "tools"),
        (chat, {"tools": [{"type": "function"}]}, "tools"),
        (chat, {"top_logprobs": 2}, "top_logprobs"),
        (chat, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0].type"),
        (chat, {"messages": [{"content": "x"}]}, "messages[0].role"),
        (chat, {"messages": "hi"}, "messages"),
    ],
)
def test_bad_requests_name_the_field(parse, body, param):
    assert refused(parse, **body).param == param


def test_usage_options_and_tools_ignored_without_tool_calls():
    options = {"include_usage": True, "continuous_usage_stats": True}
    assert completion(prompt="a", stream=True, stream_options=options).continuous_usage
    assert not completion(prompt="a", stream=True, stream_options={"continuous_usage_stats": True}).continuous_usage
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert chat(tools=tools, tool_choice="none").requests[0].chat.messages[0].content == "hi"


def test_unknown_model_is_404_and_not_an_object_is_400():
    assert refused(completion, 404, prompt="a", model="gpt-9").code == "model_not_found"
    with pytest.raises(ApiError) as err:
        parse_completion([1, 2], BOUNDS, None)
    assert err.value.status == 400


def test_grpc_codes_map_to_http_statuses_and_openai_errors():
    cases = {
        grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
        grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
        grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
        grpc.StatusCode.UNAVAILABLE: (503, "server_error"),
        grpc.StatusCode.INTERNAL: (500, "server_error"),
        grpc.StatusCode.DEADLINE_EXCEEDED: (504, "server_error"),
    }
    for code, (status, error_type) in cases.items():
        error = ApiError.from_grpc(code, "why")
        body = json.loads(error.json_bytes())
        assert (error.status, body["error"]["type"], body["error"]["message"]) == (status, error_type, "why")
        assert set(body["error"]) == {"message", "type", "param", "code"}


class _Tokens:
    """A tokenizer whose token i is the letter chr(ord('a') + i)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + i) for i in ids)


def _response(ids, text, finish=pb.FINISH_REASON_UNSPECIFIED, logprobs=(), **usage):
    r = pb.GenerateResponse(text=text, token_ids=ids, finish_reason=finish, logprobs=logprobs)
    if usage:
        r.usage.CopyFrom(pb.Usage(**usage))
    return r


def _logprob(token_id, value, *top):
    return pb.TokenLogprob(token_id=token_id, logprob=value, top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in top])


def test_whole_completion_with_logprobs_echo_and_usage():
    parsed = completion(prompt=[[0, 1], [2]], n=2, logprobs=1, stop=["zz"])
    shaper = ResponseShaper(parsed, TokenStrings(_Tokens()))
    for i in range(4):
        entries = [_logprob(3, -0.5, (4, -0.1)), _logprob(5, float("-inf"), (5, float("-inf")))]
        shaper.add(i, _response([3], "d", logprobs=entries[:1]))
        last = _response([5], "f", pb.FINISH_REASON_STOP, entries[1:], prompt_tokens=2, completion_tokens=2)
        last.stop_reason = "7" if i else "zz"
        last.usage.cached_prompt_tokens = 1
        shaper.add(i, last)
    body = shaper.body()
    first = body["choices"][0]
    assert body["object"] == "text_completion" and first["text"] == "df" and first["finish_reason"] == "stop"
    assert first["logprobs"] == {
        "text_offset": [0, 1],
        "token_logprobs": [-0.5, -9999.0],
        "tokens": ["d", "f"],
        "top_logprobs": [{"e": pytest.approx(-0.1), "d": -0.5}, {"f": -9999.0}],
    }
    assert [c["stop_reason"] for c in body["choices"]] == ["zz", 7, 7, 7]
    assert body["usage"] == {
        "prompt_tokens": 4,  # once per prompt, not per sample
        "completion_tokens": 8,
        "total_tokens": 12,
        "prompt_tokens_details": {"cached_tokens": 2},
    }
    echo = ResponseShaper(completion(prompt=[0, 1], echo=True), TokenStrings(_Tokens()))
    echo.add(0, _response([2], "c", pb.FINISH_REASON_LENGTH, prompt_tokens=2, completion_tokens=1))
    assert echo.body()["choices"][0]["text"] == "abc"


def _events(payloads: list[bytes]) -> list[dict]:
    assert all(p.startswith(b"data: ") and p.endswith(b"\n\n") for p in payloads)
    return [json.loads(p[6:]) for p in payloads]


def test_streamed_chat_chunks():
    parsed = chat(stream=True, stream_options={"include_usage": True}, logprobs=True)
    shaper = ResponseShaper(parsed, TokenStrings(_Tokens()))
    opening = _events(shaper.opening_events())
    assert opening[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert shaper.event(0, _response([], "")) is None  # nothing to show yet
    (middle,) = _events([shaper.event(0, _response([1], "b", logprobs=[_logprob(1, -1.0)]))])
    assert middle["object"] == "chat.completion.chunk" and middle["usage"] is None
    assert middle["choices"][0]["delta"] == {"content": "b"}
    assert middle["choices"][0]["logprobs"]["content"] == [
        {"token": "b", "logprob": -1.0, "bytes": [98], "top_logprobs": []}
    ]
    (last,) = _events(
        [shaper.event(0, _response([], "", pb.FINISH_REASON_LENGTH, prompt_tokens=3, completion_tokens=1))]
    )
    assert last["choices"][0]["finish_reason"] == "length" and last["choices"][0]["delta"] == {}
    (usage,) = _events([shaper.usage_event()])
    assert usage["choices"] == [] and usage["usage"]["total_tokens"] == 4
    assert DONE_EVENT == b"data: [DONE]\n\n"


async def _gen(name: str, num: int, delay: float, fail: bool = False, closed: list | None = None):
    try:
        for i in range(num):
            await asyncio.sleep(delay)
            yield pb.GenerateResponse(text=f"{name}{i}")
        if fail:
            raise Abort(grpc.StatusCode.UNAVAILABLE, "worker died")
    finally:
        if closed is not None:
            closed.append(name)


def test_merge_interleaves_and_an_error_ends_every_stream():
    async def run():
        merged = [(i, r.text) async for i, r in merge([_gen("a", 3, 0.01), _gen("b", 2, 0.015)])]
        assert sorted(merged) == [(0, "a0"), (0, "a1"), (0, "a2"), (1, "b0"), (1, "b1")]
        assert [t for i, t in merged if i == 0] == ["a0", "a1", "a2"]
        closed: list[str] = []
        with pytest.raises(Abort):
            async for _ in merge([_gen("a", 1, 0.01, fail=True), _gen("b", 100, 0.01, closed=closed)]):
                pass
        await asyncio.sleep(0.05)
        assert closed == ["b"]

    asyncio.run(run())


def test_started_waits_for_every_first_response_and_raises_early_errors():
    async def run():
        stream = await started([_gen("a", 2, 0.0), _gen("b", 2, 0.02)])
        assert sorted([(i, r.text) async for i, r in stream]) == [(0, "a0"), (0, "a1"), (1, "b0"), (1, "b1")]
        with pytest.raises(Abort):
            await started([_gen("a", 0, 0.0, fail=True), _gen("b", 5, 0.01)])

    asyncio.run(run())


def test_a_disconnect_cancels_the_work():
    async def run():
        disconnect = asyncio.Event()

        async def receive():
            await disconnect.wait()
            return {"type": "http.disconnect"}

        closed: list[str] = []

        async def work():
            async for _ in _gen("a", 1000, 0.01, closed=closed):
                pass

        asyncio.get_running_loop().call_later(0.05, disconnect.set)
        assert await cancel_on_disconnect(receive, work()) is None
        assert closed == ["a"]
        connected = asyncio.Event()  # never set: the client stays

        async def receive_nothing():
            await connected.wait()

        assert await cancel_on_disconnect(receive_nothing, asyncio.sleep(0.01, result=5)) == (5,)

    asyncio.run(run())
