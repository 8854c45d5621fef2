"""Stream migration on real processes (gateway/generation.py): a decode worker killed with SIGKILL in
the middle of a stream, and the client's stream goes on from another decode worker with exactly the
tokens the stream would have had, greedy or seeded with every filter and penalty; what the killed
worker held is freed on every survivor.

The cluster is 1P4D (a decode worker killed per test, and one left) with a prefill worker that waits
3 s before each send (and 1.5 s transfer timeouts): a stream's first token is out while its decode
worker still waits for the KV, so the kill lands mid-stream, after a token went out, whatever the
machine's speed."""

from __future__ import annotations

import signal
import time

import openai
import pytest
from cluster_helpers import greedy_request, load, metric, slow_sender_cluster, stub, wait_all_free

from splitserve.common.sampling_params import SamplingParams
from splitserve.services.engine.config import CacheConfig, EngineConfig
from splitserve.services.engine.llm import LLM
from splitserve.services.launcher.launcher import stop_cluster

PROMPT = [(5 * j) % 300 + 1 for j in range(37)]
# Exact in float32 (the public API's type), so the in-process run gets the very same values.
SEEDED = dict(
    temperature=0.75,
    top_p=0.875,
    top_k=40,
    min_p=0.03125,
    seed=2**64 - 11,
    repetition_penalty=1.25,
    presence_penalty=0.5,
    frequency_penalty=0.25,
)


@pytest.fixture(scope="module")
def moving(tiny_llama_dir):
    children = slow_sender_cluster(tiny_llama_dir, num_decode=4)
    try:
        yield children
    finally:
        stop_cluster(children)


def _unmoved(folder, params: SamplingParams):
    cache = CacheConfig(block_size=8, kv_cache_bytes=4 * 1024**2)
    return LLM(EngineConfig(model=str(folder), max_model_len=256, cache=cache)).generate([PROMPT], params)[0]


def _busy_decode(children):
    """The live decode worker that has the stream (it reserved blocks for its KV, or runs it)."""
    decodes = [c for c in children if c.name.startswith("decode") and c.proc.poll() is None]
    while True:  # bounded by the stream's deadline: the caller's next read fails if nothing is found
        for d in decodes:
            report = load(d.address)
            if report.num_running or report.num_awaiting_kv:
                return d
        time.sleep(0.01)


@pytest.mark.parametrize("kind", ["greedy", "seeded"])
def test_a_stream_moves_off_a_killed_decode_worker_with_exactly_its_tokens(moving, tiny_llama_dir, kind):
    gateway = moving[0]
    sampling = {"temperature": 0.0} if kind == "greedy" else SEEDED
    want = _unmoved(tiny_llama_dir, SamplingParams(max_tokens=60, **sampling)).token_ids
    resumed = metric(gateway.metrics, "splitserve_gateway_migrations_total", outcome="resumed")
    stream = stub(gateway.address).Generate(greedy_request(PROMPT, 60, **sampling), timeout=60)
    got = list(next(stream).token_ids)  # the prefill worker's first token; the KV waits in its delay
    victim = _busy_decode(moving)
    victim.proc.send_signal(signal.SIGKILL)
    chunks = list(stream)
    got += [t for chunk in chunks for t in chunk.token_ids]
    assert got == want
    assert chunks[-1].usage.completion_tokens == len(want) and chunks[-1].usage.prompt_tokens == len(PROMPT)
    assert metric(gateway.metrics, "splitserve_gateway_migrations_total", outcome="resumed") == resumed + 1
    survivors = [c.address for c in moving[1:] if c.proc.poll() is None]
    assert victim.address not in survivors and wait_all_free(survivors)


def test_an_http_stream_moves_too(moving, tiny_llama_dir):
    """The OpenAI API streams through the same migration: text and usage as unmoved (seeded, with filters
    and penalties the HTTP API takes as vLLM's extra parameters)."""
    gateway = moving[0]
    client = openai.OpenAI(base_url=f"http://{gateway.http}/v1", api_key="unused", max_retries=0, timeout=60)
    sampling = dict(SEEDED, seed=12345)
    want = _unmoved(tiny_llama_dir, SamplingParams(max_tokens=40, ignore_eos=True, **sampling))
    extra = {k: sampling[k] for k in ("top_k", "min_p", "repetition_penalty")} | {"ignore_eos": True}
    stream = client.completions.create(
        model=client.models.list().data[0].id,
        prompt=PROMPT,
        max_tokens=40,
        temperature=sampling["temperature"],
        top_p=sampling["top_p"],
        seed=sampling["seed"],
        presence_penalty=sampling["presence_penalty"],
        frequency_penalty=sampling["frequency_penalty"],
        stream=True,
        stream_options={"include_usage": True},
        extra_body=extra,
    )
    chunks = [next(stream)]  # the prefill worker's first token; the KV waits in its delay
    _busy_decode(moving).proc.send_signal(signal.SIGKILL)
    chunks += list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
    assert chunks[-1].usage.completion_tokens == len(want.token_ids) == 40
