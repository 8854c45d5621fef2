"""Robustness of the engine in one process: bad parameters, failing steps, held-block leases, ids.

Each test here failed on the code before the robustness issue was fixed (see docs/reliability.md).
"""

from __future__ import annotations

import asyncio
import math

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from splitserve.common.sampling_params import SamplingParams
from splitserve.common.tokenizer import Tokenizer
from splitserve.services.engine.async_engine import AsyncEngine, EngineDead, RequestFailed
from splitserve.services.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from splitserve.services.engine.core_client import EngineCoreClient
from splitserve.services.engine.detokenizer import IncrementalDetokenizer
from splitserve.services.engine.engine import Engine
from splitserve.services.engine.llm import LLM
from splitserve.services.engine.request import Request

PROMPT = [5, 17, 42, 7, 99, 3, 250, 11, 64, 8, 19]


def _config(folder, **scheduler) -> EngineConfig:
    cache = CacheConfig(block_size=8, kv_cache_bytes=2 * 1024**2)
    return EngineConfig(model=str(folder), max_model_len=256, cache=cache, scheduler=SchedulerConfig(**scheduler))


@pytest.fixture(scope="module")
def engine(tiny_llama_dir) -> Engine:
    return Engine(_config(tiny_llama_dir))


def _all_free(engine: Engine) -> bool:
    return (
        engine.kv.num_free_blocks == engine.runner.num_blocks
        and not engine.has_unfinished_requests()
        and not engine.scheduler.held
    )


def _run(engine: Engine, prompt, params: SamplingParams) -> list[int]:
    rid = engine.add_request(prompt, params)
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid:
                tokens += out.new_token_ids
    return tokens


def _unvalidated(engine: Engine, params: SamplingParams, prompt=PROMPT) -> Request:
    """A request that skipped make_request's checks: how a bug or a new parameter reaches step()."""
    rt = engine.runtime
    return Request(
        engine.make_request(prompt, SamplingParams()).request_id,
        list(prompt),
        params,
        max_tokens=params.max_tokens,
        eos_token_ids=rt.eos_token_ids,
        block_size=rt.block_size,
    )


# -- sampling parameters ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name", ["temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"]
)
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_sampling_values_are_rejected(name, value):
    with pytest.raises(ValueError, match=f"{name} must be a finite number"):
        SamplingParams(**{name: value})


@pytest.mark.parametrize("temperature", [1e-38, 1e-6, 9.9e-6])
def test_tiny_temperature_is_greedy(engine, temperature):
    greedy = _run(engine, PROMPT, SamplingParams(temperature=0.0, max_tokens=12))
    tiny = _run(engine, PROMPT, SamplingParams(temperature=temperature, max_tokens=12))
    assert tiny == greedy
    assert _all_free(engine)


def test_stop_token_ids_outside_the_vocabulary_are_rejected(engine):
    with pytest.raises(ValueError, match=r"stop_token_ids must be in \[0, 320\)"):
        engine.make_request(PROMPT, SamplingParams(stop_token_ids=[4294967295], min_tokens=2))
    assert _all_free(engine)


# -- a failing step fails only what it concerns ----------------------------------------------------


def test_request_whose_sampling_raises_fails_alone(engine):
    good = engine.make_request(PROMPT, SamplingParams(temperature=0.0, max_tokens=10))
    bad = _unvalidated(
        engine, SamplingParams(temperature=0.0, max_tokens=10, min_tokens=3, stop_token_ids=[4294967295])
    )
    engine.add_request(good)
    engine.add_request(bad)
    outputs = {good.request_id: [], bad.request_id: []}
    errors = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] += out.new_token_ids
            if out.error:
                errors[out.request_id] = out.error
    assert list(errors) == [bad.request_id] and "IndexError" in errors[bad.request_id]
    assert outputs[good.request_id] == _run(engine, PROMPT, SamplingParams(temperature=0.0, max_tokens=10))
    assert engine.stats.num_failed_requests >= 1
    assert _all_free(engine)


def test_failed_forward_fails_its_batch_and_the_engine_goes_on(tiny_llama_dir, monkeypatch):
    engine = Engine(_config(tiny_llama_dir))
    want = _run(engine, PROMPT, SamplingParams(temperature=0.0, max_tokens=6))
    real_forward = engine.runner.forward

    def broken(batch, layers=None):
        monkeypatch.setattr(engine.runner, "forward", real_forward)  # once
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(engine.runner, "forward", broken)
    rids = [engine.add_request(PROMPT, SamplingParams(temperature=0.0, max_tokens=6)) for _ in range(2)]
    outputs = engine.step()
    assert sorted(o.request_id for o in outputs) == sorted(rids)
    assert all(o.finished and "illegal memory access" in o.error for o in outputs)
    assert _all_free(engine)
    assert _run(engine, PROMPT, SamplingParams(temperature=0.0, max_tokens=6)) == want


def test_async_engine_fails_the_request_and_keeps_serving(engine):
    async def main():
        aengine = AsyncEngine(engine)
        bad = _unvalidated(engine, SamplingParams(temperature=0.0, max_tokens=5, min_tokens=2, stop_token_ids=[10**9]))
        with pytest.raises(RequestFailed, match="the worker goes on"):
            async for _ in aengine.generate_request(bad):
                pass
        tokens = [
            t
            async for out in aengine.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=5))
            for t in out.new_token_ids
        ]
        assert not aengine.died.is_set()
        await aengine.shutdown()
        return tokens

    assert asyncio.run(main()) == _run(engine, PROMPT, SamplingParams(temperature=0.0, max_tokens=5))
    assert _all_free(engine)


def test_dead_loop_fails_every_stream_and_refuses_new_requests(tiny_llama_dir, monkeypatch):
    engine = Engine(_config(tiny_llama_dir))

    def broken_schedule():
        raise AssertionError("scheduler invariant broken")

    monkeypatch.setattr(engine.scheduler, "schedule", broken_schedule)

    async def main():
        aengine = EngineCoreClient.in_process(engine)  # the server's path
        with pytest.raises(EngineDead, match="scheduler invariant broken"):
            async for _ in aengine.generate(PROMPT, SamplingParams(max_tokens=4)):
                pass
        await asyncio.wait_for(aengine.died.wait(), 5)
        with pytest.raises(EngineDead, match="retry the request on another worker"):
            async for _ in aengine.generate(PROMPT, SamplingParams(max_tokens=4)):
                pass

    asyncio.run(main())


# -- prefill tier: held blocks under a lease -------------------------------------------------------


def _hold(engine: Engine) -> str:
    """Run a prefill-tier request to its first token; its blocks stay held."""
    request = engine.make_request(PROMPT * 2, SamplingParams(temperature=0.0, max_tokens=8), stop_after_prefill=True)
    engine.add_request(request)
    while engine.has_unfinished_requests():
        engine.step()
    assert request.request_id in engine.scheduler.held
    return request.request_id


def test_unclaimed_held_blocks_expire_with_their_lease(engine):
    rid = _hold(engine)
    assert engine.num_held_blocks() == 3
    assert engine.expire_leases() == 0  # not yet
    expired = engine.leases.num_expired
    assert engine.expire_leases(now=engine.leases.next_deadline()) == 1
    assert engine.leases.num_expired == expired + 1
    assert not engine.claim_held(rid)  # a sender arriving late finds nothing to send
    assert _all_free(engine)


def test_claimed_held_blocks_do_not_expire_and_abort_waits_for_the_sender(engine):
    rid = _hold(engine)
    assert engine.claim_held(rid)
    assert engine.expire_leases(now=float("inf")) == 0
    engine.abort_request(rid)  # the send is reading the blocks: only its release frees them
    assert engine.num_held_blocks() == 3
    assert engine.release_held(rid)
    assert _all_free(engine)


def test_abort_before_the_send_releases_held_blocks(engine):
    rid = _hold(engine)
    assert engine.abort_request(rid)
    assert _all_free(engine)


def test_prefill_cancelled_during_its_first_token_step_leaks_nothing(engine, monkeypatch):
    """The Prefill RPC is cancelled while the step that samples its first token runs."""

    async def main():
        aengine = AsyncEngine(engine)
        stepping = asyncio.Event()
        loop = asyncio.get_running_loop()
        real_step = engine.step

        def slow_step():
            loop.call_soon_threadsafe(stepping.set)
            import time

            time.sleep(0.3)
            return real_step()

        monkeypatch.setattr(engine, "step", slow_step)
        request = engine.make_request(PROMPT * 2, SamplingParams(max_tokens=8), stop_after_prefill=True)

        async def consume():
            async for _ in aengine.generate_request(request):
                pass

        task = asyncio.create_task(consume())
        await stepping.wait()
        task.cancel()
        for _ in range(100):
            await asyncio.sleep(0.02)
            if _all_free(engine):
                break
        await aengine.shutdown()

    asyncio.run(main())
    assert _all_free(engine)


# -- ids, stop strings, queue, tokenizer -----------------------------------------------------------


def test_an_id_in_use_by_a_held_request_cannot_be_reused(engine):
    rid = _hold(engine)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request(PROMPT, SamplingParams(max_tokens=2), request_id=rid)
    engine.release_held(rid)
    assert _all_free(engine)


def test_server_side_ids_are_unique_whatever_the_label(engine):
    a = engine.make_request(PROMPT, SamplingParams(), label="client-1")
    b = engine.make_request(PROMPT, SamplingParams(), label="client-1")
    assert a.request_id != b.request_id and a.label == b.label == "client-1"


def test_stop_strings_honour_min_tokens(tiny_llama_dir):
    llm = LLM(_config(tiny_llama_dir))
    free = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=12))[0]
    stop = free.text[:2] if free.text[:2].strip() else free.text[:3]
    early = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=12, stop=[stop]))[0]
    assert early.finish_reason.value == "stop" and len(early.token_ids) < 4
    late = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=12, stop=[stop], min_tokens=6))[0]
    assert late.token_ids[:6] == free.token_ids[:6]
    assert len(late.token_ids) >= 6


def test_prompt_over_the_token_budget_without_chunked_prefill_is_refused(tiny_llama_dir):
    engine = Engine(_config(tiny_llama_dir, enable_chunked_prefill=False, max_num_batched_tokens=64))
    with pytest.raises(ValueError, match="chunked prefill is off"):
        engine.add_request([3] * 60, SamplingParams(max_tokens=10))
    assert _run(engine, [3] * 40, SamplingParams(temperature=0.0, max_tokens=10))  # fits: runs
    assert _all_free(engine)


def _metaspace_tokenizer() -> Tokenizer:
    """A SentencePiece-style (Llama 2 / Mistral) tokenizer: the decoder drops a sequence's first space."""
    words = ["▁The", "▁capital", "▁of", "▁France", "▁is", "▁Paris", "."]
    backend = HFTokenizer(models.WordLevel({w: i for i, w in enumerate(["<unk>", *words])}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    return Tokenizer(backend, eos_token_ids=frozenset(), bos_token_id=None, add_bos=False, chat_template=None)


def test_first_output_token_keeps_its_leading_space_with_metaspace_tokenizers():
    tok = _metaspace_tokenizer()
    prompt = tok.encode("The capital of France is")
    detok = IncrementalDetokenizer(tok, SamplingParams(), prompt)
    detok.add_tokens([tok.token_to_id("▁Paris"), tok.token_to_id(".")])
    detok.flush()
    assert detok.take_delta(finished=True) == " Paris."
    assert tok.decode(prompt) + detok.text == "The capital of France is Paris."
