"""The gateway's OpenAI-compatible HTTP API (docs/openai.md) on real processes, through the official
`openai` client: one 1P1D cluster (tiny Llama with a chat template) for most tests; outputs are
token-exact against the gRPC API's for the same requests.
"""

from __future__ import annotations

import json
import socket
import time

import grpc
import httpx
import openai
import pytest
from cluster_helpers import engine_argv, greedy_request, metric, stub, wait_all_free, write_chat_model

from splitserve.protos.v1 import generation_pb2 as pb
from splitserve.protos.v1 import generation_pb2_grpc as pb_grpc
from splitserve.services.launcher.launcher import start_cluster, stop_cluster

MAX_PENDING = 4
PROMPT_IDS = [[1, 5, 9, 13, 17, 21, 25, 29, 33, 37, 41], [2, 4, 6, 8], list(range(3, 40))]
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the quick brown fox"}]


@pytest.fixture(scope="module")
def chat_model(tiny_llama_dir, tmp_path_factory):
    return write_chat_model(tiny_llama_dir, tmp_path_factory.mktemp("chat") / "tiny-llama-chat")


@pytest.fixture(scope="module")
def cluster(chat_model):
    children = start_cluster(
        0, engine_argv(chat_model), num_prefill=1, num_decode=1, gateway_argv=["--max-pending", str(MAX_PENDING)]
    )
    try:
        yield children
    finally:
        stop_cluster(children)


@pytest.fixture(scope="module")
def client(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{cluster[0].http}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def _grpc_text(cluster, request: pb.GenerateRequest) -> tuple[str, list[float]]:
    """The text and logprobs gRPC gives (logprobs differ in the last bits when a prompt hits the prefix cache)."""
    chunks = list(stub(cluster[0].address).Generate(request, timeout=60))
    return "".join(c.text for c in chunks), [lp.logprob for c in chunks for lp in c.logprobs]


def test_models_and_health_routes(cluster, client, model):
    card = client.models.retrieve(model)
    assert card.id == model and card.owned_by == "splitserve" and card.model_extra["max_model_len"] == 256
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-9")
    base = f"http://{cluster[0].http}"
    assert httpx.get(f"{base}/health").status_code == 200
    assert httpx.get(f"{base}/ready").json() == {"ready": True, "model": model}
    assert "splitserve_gateway_http_requests_total" in httpx.get(f"{base}/metrics").text


def test_completions_are_token_exact_with_grpc_greedy_and_seeded(cluster, client, model):
    for ids in PROMPT_IDS:
        for sampling in ({"temperature": 0.0}, {"temperature": 0.9, "top_p": 0.95, "seed": 11}):
            http = client.completions.create(model=model, prompt=ids, max_tokens=12, logprobs=0, **sampling)
            request = greedy_request(ids, 12, **sampling)
            request.logprobs = 0
            text, logprobs = _grpc_text(cluster, request)
            choice = http.choices[0]
            assert choice.text == text and choice.logprobs.token_logprobs == pytest.approx(logprobs, abs=1e-4)
            assert http.usage.completion_tokens == len(logprobs) == 12 and choice.finish_reason == "length"


def test_chat_is_token_exact_with_grpc_and_streams_the_same(cluster, client, model):
    whole = client.chat.completions.create(model=model, messages=CHAT, max_tokens=10, temperature=0)
    chat = pb.ChatMessages(messages=[pb.ChatMessage(**m) for m in CHAT])
    request = pb.GenerateRequest(
        chat=chat, sampling=pb.SamplingParameters(temperature=0), stopping=pb.StoppingCriteria(max_tokens=10)
    )
    assert whole.choices[0].message.content == _grpc_text(cluster, request)[0]
    assert whole.object == "chat.completion" and whole.id.startswith("chatcmpl-")
    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=CHAT,
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0  # the same prompt ran just before


def test_streamed_completion_equals_the_whole_one(client, model):
    kwargs = dict(model=model, prompt="the quick brown fox", max_tokens=16, temperature=0, logprobs=2)
    whole = client.completions.create(**kwargs).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(stream=True, **kwargs)]
    assert "".join(c.text for c in chunks) == whole.text
    assert [lp for c in chunks for lp in c.logprobs.token_logprobs] == whole.logprobs.token_logprobs
    assert [t for c in chunks for t in c.logprobs.tokens] == whole.logprobs.tokens
    tops = whole.logprobs.top_logprobs  # the 2 best and the sampled token (strings may coincide: '\ufffd')
    assert all(token in top and len(top) <= 3 for token, top in zip(whole.logprobs.tokens, tops))
    assert whole.logprobs.text_offset[0] == 0 and chunks[-1].finish_reason == "length"


def test_chat_logprobs(client, model):
    out = client.chat.completions.create(
        model=model, messages=CHAT, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3
    )
    entries = out.choices[0].logprobs.content
    assert len(entries) == 5 and all(len(e.top_logprobs) == 3 for e in entries)
    assert all(e.bytes == list(e.token.encode()) and e.logprob <= 0 for e in entries)
    greedy = [max(e.top_logprobs, key=lambda t: t.logprob) for e in entries]
    assert [e.token for e in entries] == [t.token for t in greedy]  # temperature 0 takes the top one


def test_n_samples_use_seed_plus_index_and_prompt_lists(cluster, client, model):
    out = client.completions.create(
        model=model, prompt=PROMPT_IDS[:2], n=2, max_tokens=8, temperature=1.0, seed=100, logprobs=0
    )
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    for choice in out.choices:
        ids, sample = PROMPT_IDS[choice.index // 2], choice.index % 2
        text, logprobs = _grpc_text(cluster, _seeded(ids, 100 + sample))
        assert choice.text == text and choice.logprobs.token_logprobs == pytest.approx(logprobs, abs=1e-4)
    assert out.choices[0].text != out.choices[1].text
    assert out.usage.completion_tokens == 4 * 8
    again = client.completions.create(model=model, prompt=PROMPT_IDS[:2], n=2, max_tokens=8, temperature=1.0, seed=100)
    assert [c.text for c in again.choices] == [c.text for c in out.choices]
    streamed = client.completions.create(
        model=model, prompt=PROMPT_IDS[0], n=2, max_tokens=8, temperature=1.0, seed=100, stream=True
    )
    texts = ["", ""]
    for chunk in streamed:
        texts[chunk.choices[0].index] += chunk.choices[0].text
    assert texts == [c.text for c in out.choices[:2]]


def _seeded(ids: list[int], seed: int) -> pb.GenerateRequest:
    request = greedy_request(ids, 8, temperature=1.0, seed=seed)
    request.logprobs = 0
    return request


def test_echo_stop_and_extra_parameters(client, model):
    out = client.completions.create(model=model, prompt="the quick", max_tokens=4, temperature=0, echo=True)
    assert out.choices[0].text.startswith("the quick")
    free = client.completions.create(model=model, prompt=PROMPT_IDS[0], max_tokens=12, temperature=0).choices[0].text
    stop = next(c for c in free[2:] if c.isascii() and c.isalpha())  # a whole character, not a byte of one
    stopped = client.completions.create(model=model, prompt=PROMPT_IDS[0], max_tokens=12, temperature=0, stop=[stop])
    assert stopped.choices[0].finish_reason == "stop" and stopped.choices[0].model_extra["stop_reason"] == stop
    assert stop not in stopped.choices[0].text and free.startswith(stopped.choices[0].text)
    extra = client.completions.create(
        model=model,
        prompt=PROMPT_IDS[1],
        max_tokens=6,
        temperature=0.5,
        extra_body={"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.2, "min_tokens": 6, "ignore_eos": True},
    )
    assert extra.usage.completion_tokens == 6


def test_errors_have_openai_shape_and_status(cluster, client, model):
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="gpt-9", prompt="hi")
    assert err.value.body["code"] == "model_not_found" and err.value.body["param"] == "model"
    bad = [
        dict(prompt="hi", temperature=-1),
        dict(prompt=[1] * 300),
        dict(prompt=[]),
        dict(prompt="hi", extra_body={"logit_bias": {"1": 5}}),
        dict(prompt="hi", n=MAX_PENDING + 1),
        dict(prompt="hi", stream_options={"include_usage": True}),
    ]
    for kwargs in bad:
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model=model, **kwargs)
        assert err.value.body["type"] == "invalid_request_error" and err.value.body["message"]
    response = httpx.post(f"http://{cluster[0].http}/v1/completions", content=b"{not json")
    assert response.status_code == 400 and "not valid JSON" in response.json()["error"]["message"]
    assert httpx.get(f"http://{cluster[0].http}/v1/nothing").json()["error"]["type"] == "not_found_error"


def test_overload_is_429_on_both_apis(cluster, client, model):
    """MAX_PENDING generations in flight (one HTTP stream with n = MAX_PENDING): the next is refused.

    The hold lasts under a second on an idle machine, so both checks go out on warm connections once the
    gateway counts all of the hold's generations in flight (on a loaded CI machine the hold once ended
    before the checks did).
    """
    grpc_channel = grpc.insecure_channel(cluster[0].address)
    grpc.channel_ready_future(grpc_channel).result(timeout=30)
    grpc_stub = pb_grpc.GenerationStub(grpc_channel)
    hold = {"prompt": [7] * 10, "n": MAX_PENDING, "max_tokens": 240, "extra_body": {"ignore_eos": True}}
    with client.completions.with_streaming_response.create(model=model, temperature=0, stream=True, **hold) as held:
        events = held.iter_lines()  # kept: a dropped iterator closes the response, and the gateway cancels the hold
        assert next(events)
        deadline = time.monotonic() + 10
        while metric(cluster[0].metrics, "splitserve_gateway_requests_in_flight") < MAX_PENDING:
            assert time.monotonic() < deadline, "the hold's generations never were all in flight"
            time.sleep(0.005)
        with pytest.raises(grpc.RpcError) as rpc_err:
            list(grpc_stub.Generate(greedy_request([1, 2], 2), timeout=30))
        assert rpc_err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        with pytest.raises(openai.RateLimitError) as err:
            client.completions.create(model=model, prompt="hi", max_tokens=2)
        assert "--max-pending" in err.value.message
    grpc_channel.close()
    assert wait_all_free([w.address for w in cluster[1:]])


def test_client_disconnect_frees_kv_blocks_on_every_tier(cluster, model):
    workers = [w.address for w in cluster[1:]]
    cancelled = metric(cluster[0].metrics, "splitserve_gateway_requests_total", code="CANCELLED")
    url = f"http://{cluster[0].http}/v1/chat/completions"
    body = {"model": model, "messages": CHAT, "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url, json=body, timeout=60) as response:
        lines = response.iter_lines()
        assert [next(lines) for _ in range(6)]  # a few events: the request runs on both workers
    assert wait_all_free(workers)
    _wait_counted(cluster[0], cancelled + 1)  # before the next: else its n generations pass --max-pending
    # not streamed: the client leaves while its MAX_PENDING generations run (none of their tokens sent yet)
    payload = json.dumps({**body, "stream": False, "n": MAX_PENDING}).encode()
    host, port = cluster[0].http.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        sock.sendall(f"{head}Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
        deadline = time.monotonic() + 10
        while metric(cluster[0].metrics, "splitserve_gateway_requests_in_flight") < MAX_PENDING:
            assert time.monotonic() < deadline, "the request's generations never were all in flight"
            time.sleep(0.005)
    assert wait_all_free(workers)
    _wait_counted(cluster[0], cancelled + 2)


def _wait_counted(gateway, num_cancelled: int) -> None:
    """Until the gateway has counted num_cancelled requests as cancelled and has none in flight."""
    deadline = time.monotonic() + 10
    while (
        metric(gateway.metrics, "splitserve_gateway_requests_total", code="CANCELLED") < num_cancelled
        or metric(gateway.metrics, "splitserve_gateway_requests_in_flight") > 0
    ):
        assert time.monotonic() < deadline, f"the gateway did not count {num_cancelled} requests as cancelled"
        time.sleep(0.05)


def test_tokenize_and_detokenize(cluster, model):
    base = f"http://{cluster[0].http}"
    out = httpx.post(f"{base}/tokenize", json={"model": model, "prompt": "the quick", "return_token_strs": True})
    tokens = out.json()["tokens"]
    assert out.json()["count"] == len(tokens) and "".join(out.json()["token_strs"]) == "the quick"
    assert httpx.post(f"{base}/detokenize", json={"tokens": tokens}).json() == {"prompt": "the quick"}
    chat = httpx.post(f"{base}/tokenize", json={"messages": CHAT}).json()
    assert chat["count"] == len(chat["tokens"]) > len(tokens)
    assert httpx.post(f"{base}/detokenize", json={"tokens": [10**6]}).status_code == 400
