"""Robustness of the engine in one process: bad parameters, failing steps, held-block leases, ids.

Each test here failed on the code before the robustness issue was fixed (see docs/reliability.md).
"""

from __future__ import annotations

import asyncio
import math
import threading
from dataclasses import dataclass

import pytest
import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from splitserve.common.sampling_params import SamplingParams
from splitserve.common.tokenizer import Tokenizer
from splitserve.common.wire import params_to_proto
from splitserve.protos.v1 import worker_pb2 as wpb
from splitserve.services.disagg.handoff import HandoffJob, PieceJob
from splitserve.services.disagg.plan import Piece
from splitserve.services.disagg.prefill import CorePrefillSetup
from splitserve.services.disagg.prefill_client import job_to_proto
from splitserve.services.disagg.transfer.base import ChannelSpec, Fill, KVSender, Moved
from splitserve.services.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from splitserve.services.engine.core_client import CoreRefused, EngineCoreClient
from splitserve.services.engine.detokenizer import IncrementalDetokenizer
from splitserve.services.engine.engine import Engine
from splitserve.services.engine.handoff_port import EngineLoad
from splitserve.services.engine.llm import LLM
from splitserve.services.engine.request import Request, RequestId
from splitserve.services.engine.step_loop import EngineDead, StepLoop
from splitserve.services.engine.streams import RequestFailed

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


def _idle(load: EngineLoad) -> bool:
    """Nothing running, waiting, awaiting KV or held, and every block free."""
    busy = load.num_running or load.num_waiting or load.num_awaiting_kv or load.num_held_requests
    return not busy and load.num_free_blocks == load.num_total_blocks


def _run(engine: Engine, prompt, params: SamplingParams) -> list[int]:
    rid = engine.add_request(prompt, params)
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid:
                tokens += out.new_token_ids
    return tokens


def _unvalidated(engine: Engine, params: SamplingParams, prompt=PROMPT, request_id: str | None = None) -> Request:
    """A request that skipped make_request's checks: how a bug or a new parameter reaches step()."""
    rt = engine.runtime
    return Request(
        RequestId(request_id) if request_id is not None else engine.make_request(prompt, SamplingParams()).request_id,
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


def _skip_validation(engine: Engine, monkeypatch, skipped_label: str) -> None:
    """The core validates each request it is sent (Engine.make_request) and refuses a bad one; a
    request carrying this label skips those checks, as one that a bug or a new parameter lets through."""
    make_request = engine.make_request

    def maybe_unvalidated(prompt, params, request_id=None, priority=0, stop_after_prefill=False, label="", **more):
        if label == skipped_label:
            return _unvalidated(engine, params, prompt, request_id)
        if label == "breaks-validation":  # a bug in the checks themselves
            raise KeyError("a bug")
        return make_request(prompt, params, request_id, priority, stop_after_prefill, label, **more)

    monkeypatch.setattr(engine, "make_request", maybe_unvalidated)


def test_a_core_refuses_or_fails_a_bad_request_and_keeps_serving(engine, monkeypatch):
    """Through the serving path (an engine core and its client): a request whose parameters the core
    validates is refused with ValueError; one whose validation itself raises (a bug) is refused
    INTERNAL, not left waiting by a dead command reader; one that got past validation fails in the
    step, and ends with RequestFailed; either way the core serves the next request as before and
    frees every block."""
    _skip_validation(engine, monkeypatch, "unvalidated")
    bad = SamplingParams(temperature=0.0, max_tokens=5, min_tokens=2, stop_token_ids=[10**9])
    good = SamplingParams(temperature=0.0, max_tokens=5)

    async def main() -> tuple[list[int], EngineLoad]:
        client = EngineCoreClient.in_process(engine)
        with pytest.raises(ValueError, match=r"stop_token_ids must be in \[0, 320\)"):
            async for _ in client.generate(PROMPT, bad):
                pass
        with pytest.raises(CoreRefused, match="KeyError") as broken:
            async for _ in client.generate(PROMPT, good, label="breaks-validation"):
                pass
        assert broken.value.code == "INTERNAL"
        with pytest.raises(RequestFailed, match="IndexError.*the worker goes on"):
            async for _ in client.generate(PROMPT, bad, label="unvalidated"):
                pass
        tokens = [t async for out in client.generate(PROMPT, good) for t in out.new_token_ids]
        load = client.load()  # as of the step that ended the last stream
        assert not client.died.is_set()
        await client.shutdown()
        return tokens, load

    tokens, load = asyncio.run(main())
    assert load.num_failed_requests >= 1 and _idle(load)
    assert tokens == _run(engine, PROMPT, good)
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


class _UnreceivedSender(KVSender):
    """Each send waits for a receive that never comes (a decode worker that is gone) until it is cancelled."""

    def connect(self, channel: ChannelSpec) -> None:
        pass

    async def send(self, channel: ChannelSpec, tag: int, blocks: torch.Tensor, fill: Fill | None = None) -> Moved:
        await asyncio.get_running_loop().create_future()
        raise AssertionError("unreachable")


@dataclass(frozen=True)
class _UnreceivedPrefill(CorePrefillSetup):
    """A prefill core whose KV sends are never received."""

    def make_sender(self, device: torch.device) -> KVSender:
        return _UnreceivedSender()


def _prefill_call(engine: Engine, prompt: list[int], params: SamplingParams) -> wpb.PrefillRequest:
    """A decode worker's Prefill call for prompt (every KV head, on one channel)."""
    channel = ChannelSpec("127.0.0.1:1", "decode->prefill#0", secret=b"s" * 32)
    piece = PieceJob(Piece(0, 0, range(engine.runner.arch.num_kv_heads)), channel, tag=1)
    job = HandoffJob((piece,), num_skip_blocks=0, kv_layout=engine.runner.kv_layout)
    wire = wpb.WorkerGenerateRequest(request_id="prefill", prompt_token_ids=prompt, params=params_to_proto(params))
    return job_to_proto(job, wire)


def _num_steps(load: EngineLoad) -> int:
    return sum(totals.num_steps for totals in load.steps.values())


async def _settled(client: EngineCoreClient, num_steps: int, timeout_s: float = 10.0) -> EngineLoad:
    """The first load the core reports with num_steps steps run, nothing running or held and every
    block free (a report's step totals are as new as its counts, or older)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        load = client.load()
        if _num_steps(load) >= num_steps and _idle(load) or loop.time() > deadline:
            return load
        await asyncio.sleep(0.01)


def test_prefill_cancelled_during_its_first_token_step_leaks_nothing(engine, monkeypatch):
    """The Prefill call is cancelled while the step that samples its first token runs: its abort
    reaches the core during that step, and the prompt's blocks (held at its first token, perhaps
    claimed meanwhile by a send that would never end) all come back before the core stops."""
    stepping, aborted = threading.Event(), threading.Event()
    real_step, real_post = engine.step, StepLoop.post

    def held_step():  # the step waits, once it runs, until the abort is queued behind it
        stepping.set()
        aborted.wait(10)
        return real_step()

    def post(self: StepLoop, fn, *args) -> None:
        real_post(self, fn, *args)
        if fn == engine.abort_request:
            aborted.set()

    monkeypatch.setattr(engine, "step", held_step)
    monkeypatch.setattr(StepLoop, "post", post)
    setup = _UnreceivedPrefill("127.0.0.1", transfer_timeout_s=5.0, kv_streaming=False)
    call = _prefill_call(engine, PROMPT * 2, SamplingParams(max_tokens=8))

    async def main() -> EngineLoad:
        client = EngineCoreClient.in_process(engine, handoffs=setup)
        num_steps = _num_steps(client.load())  # the engine's, so far

        async def prefill() -> None:
            async for _ in client.prefill(call):
                pass

        task = asyncio.create_task(prefill())
        assert await asyncio.to_thread(stepping.wait, 10)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await asyncio.to_thread(aborted.wait, 10)
        load = await _settled(client, num_steps + 1)  # before the shutdown, which aborts whatever is left
        await client.shutdown()
        return load

    load = asyncio.run(main())
    assert _idle(load) and load.num_held_blocks == 0
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
