"""Output processing off the step loop (services/engine/output_processor.py): stop strings still end their
request within one step, streamed text stays equal to the final text, and cancellation drops a
request's outputs and frees its blocks, whether outputs are processed inline or by the serving side
of an engine core (here in process).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest

from splitserve.common.sampling_params import SamplingParams
from splitserve.common.wire import params_to_proto
from splitserve.protos.v1 import worker_pb2 as wpb
from splitserve.services.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from splitserve.services.engine.core_client import EngineCoreClient
from splitserve.services.engine.engine import Engine, RequestOutput
from splitserve.services.engine.output_processor import OutputProcessor
from splitserve.services.engine.outputs import StepTokens
from splitserve.services.engine.request import FinishReason, Request, RequestId, RequestStatus

PROMPTS = [[5, 17, 42, 7, 99, 3], [250, 11, 64, 8], [19, 23, 1, 77, 140, 31, 2], [9, 9, 8]]
MAX_TOKENS = 24


def _config(folder) -> EngineConfig:
    cache = CacheConfig(block_size=4, kv_cache_bytes=2 * 1024**2)
    return EngineConfig(model=str(folder), max_model_len=128, cache=cache, scheduler=SchedulerConfig(max_num_seqs=8))


@pytest.fixture(scope="module")
def engine(tiny_llama_dir) -> Engine:
    return Engine(_config(tiny_llama_dir))


def _all_free(engine: Engine) -> bool:
    return engine.kv.num_free_blocks == engine.runner.num_blocks and not engine.has_unfinished_requests()


def _greedy(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, **kwargs)


def _inline(engine: Engine, params: list[SamplingParams]) -> dict[int, list[RequestOutput]]:
    """Each prompt's outputs, processed in the step loop (no output thread)."""
    ids = [engine.add_request(p, sp) for p, sp in zip(PROMPTS, params)]
    outputs: dict[str, list[RequestOutput]] = {rid: [] for rid in ids}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id].append(out)
    return {i: outputs[rid] for i, rid in enumerate(ids)}


def _stop_strings(engine: Engine) -> list[SamplingParams]:
    """Per prompt, a stop string its greedy text reaches mid-way (across a token boundary)."""
    free = _inline(engine, [_greedy()] * len(PROMPTS))
    params = []
    for outs in free.values():
        text = "".join(o.new_text for o in outs)
        assert len(text) > 12, "the tiny model's text is too short to cut"
        params.append(_greedy(stop=[text[6:9]]))
    return params


def _text(outputs: list[RequestOutput]) -> str:
    return "".join(o.new_text for o in outputs)


def _tokens(outputs: list[RequestOutput]) -> list[int]:
    return [t for o in outputs for t in o.new_token_ids]


def test_stop_strings_found_by_a_slow_serving_side_end_within_one_step_with_the_inline_text(engine, monkeypatch):
    """A core's serving side processes outputs several steps behind the step loop; the engine waits
    for it only as much as a stop string needs to end its request within one step."""
    params = _stop_strings(engine)
    want = _inline(engine, params)
    added: dict[str, Request] = {}  # the engine's requests, as the core adds them
    add_request, process = engine.add_request, OutputProcessor.process

    def record(request, *args, **kwargs):
        added[request.request_id] = request
        return add_request(request, *args, **kwargs)

    def slow_process(self, step, pause=None):  # several steps behind the step loop
        time.sleep(0.1)
        return process(self, step, pause)

    monkeypatch.setattr(engine, "add_request", record)
    monkeypatch.setattr(OutputProcessor, "process", slow_process)

    async def main() -> list[list[RequestOutput]]:
        client = EngineCoreClient.in_process(engine)

        async def collect(i: int) -> list[RequestOutput]:
            return [out async for out in client.generate(PROMPTS[i], params[i], request_id=f"r{i}")]

        got = await asyncio.gather(*(collect(i) for i in range(len(PROMPTS))))
        await client.shutdown()
        return got

    for i, got in enumerate(asyncio.run(main())):
        assert _tokens(got) == _tokens(want[i])
        assert _text(got) == _text(want[i]) and params[i].stop[0] not in _text(got)
        final = got[-1]
        assert final.finished and sum(o.finished for o in got) == 1
        assert final.finish_reason is FinishReason.STOP and final.stop_reason == params[i].stop[0]
        # The engine may have computed one token past the stop string, never more, and streamed none.
        assert added[f"r{i}"].num_output_tokens <= final.num_output_tokens + 1
    assert _all_free(engine)


def test_an_aborted_request_ends_with_an_abort_output_and_others_keep_their_text(engine):
    want = _inline(engine, [_greedy()] * len(PROMPTS))

    async def main() -> list[list[RequestOutput]]:
        client = EngineCoreClient.in_process(engine)

        async def collect(i: int) -> list[RequestOutput]:
            outs = []
            async for out in client.generate(PROMPTS[i], _greedy(), label=f"p{i}"):
                outs.append(out)
                if i == 1 and len(outs) == 2:
                    assert client.abort_label("p1") == 1  # the Abort RPC's path
            return outs

        got = await asyncio.gather(*(collect(i) for i in range(len(PROMPTS))))
        assert await _freed(engine)
        await client.shutdown()
        return got

    got = asyncio.run(main())
    *before, final = got[1]  # the abort's final output carries what was queued for the stream (merged)
    assert len(before) == 2 and not any(o.finished for o in before)
    assert final.finished and final.finish_reason is FinishReason.ABORT
    assert final.num_output_tokens == len(_tokens(got[1])) < MAX_TOKENS
    assert _text(got[1]) == _text(want[1])[: len(_text(got[1]))]
    for i in (0, 2, 3):
        assert _text(got[i]) == _text(want[i])
    assert _all_free(engine)


async def _freed(engine: Engine) -> bool:
    """Whether the engine holds nothing within 2 s (an abort reaches the step loop between steps):
    asked before a core's shutdown, which aborts whatever is left."""
    for _ in range(100):
        if _all_free(engine):
            return True
        await asyncio.sleep(0.02)
    return False


def test_streams_through_a_core_with_stop_strings_and_cancellation(engine):
    """The server's path (the engine core and its client, here in process): stop strings found in the
    serving side end their requests as inline, slow consumers get merged chunks, a cancel frees its blocks."""
    params = _stop_strings(engine)
    want = _inline(engine, params)

    async def main():
        aengine = EngineCoreClient.in_process(engine)

        async def collect(i: int) -> list[RequestOutput]:
            outs = []
            async for out in aengine.generate(PROMPTS[i], params[i]):
                outs.append(out)
                await asyncio.sleep(0.01 * i)  # slow consumers get merged chunks
            return outs

        async def cancelled() -> None:
            async for _ in aengine.generate([3] * 30, _greedy(stop=["never appears \u2603"])):
                await asyncio.sleep(10)  # cancelled here, after its first chunk

        victim = asyncio.create_task(cancelled())
        got = await asyncio.gather(*(collect(i) for i in range(len(PROMPTS))))
        victim.cancel()
        with pytest.raises(asyncio.CancelledError):
            await victim
        assert await _freed(engine)
        await aengine.shutdown()
        return got

    got = asyncio.run(main())
    for i, outs in enumerate(got):
        assert _text(outs) == _text(want[i])
        assert outs[-1].finished and outs[-1].finish_reason is FinishReason.STOP
        assert [t for o in outs for t in o.new_token_ids] == [t for o in want[i] for t in o.new_token_ids]
    assert _all_free(engine)


# -- the processor alone ----------------------------------------------------------------------------


def _request(rid: str, params: SamplingParams) -> Request:
    return Request(RequestId(rid), [1, 2, 3], params, max_tokens=50, eos_token_ids=frozenset(), block_size=4)


def test_processor_drops_tokens_after_a_stop_and_of_forgotten_requests(engine):
    tok = engine.tokenizer
    ids = tok.encode("the quick brown fox jumps over the lazy dog")
    stop = "brown"
    processor = OutputProcessor(tok)
    a, b = _request("a", SamplingParams(stop=[stop])), _request("b", SamplingParams())
    processor.add(a, arrival=0.0)
    processor.add(b, arrival=0.0)
    streamed: dict[str, str] = {"a": "", "b": ""}
    finished_at = None
    for step, token in enumerate(ids):
        done = processor.process(StepTokens([a, b], [token, token], {}, time=1.0))
        for out in done.outputs:
            streamed[out.request_id] += out.new_text
            if out.finished:
                finished_at = step
                assert out.stop_reason == stop and out.finish_reason is FinishReason.STOP
                assert done.to_finish == [("a", RequestStatus.FINISHED_STOPPED)]
        if step == 4:
            final = processor.abort("b")
            assert final is not None and final.finish_reason is FinishReason.ABORT and final.num_output_tokens == 5
            assert processor.abort("b") is None  # one final output
    assert finished_at is not None and streamed["a"] == tok.decode(ids).split(stop)[0]
    assert streamed["b"] == tok.decode(ids[:5])[: len(streamed["b"])]
    assert processor.abort("a") is None and processor.abort("b") is None  # neither is tracked any more


def test_processor_isolates_a_request_whose_processing_fails(engine):
    processor = OutputProcessor(engine.tokenizer)
    good, bad = _request("good", SamplingParams()), _request("bad", SamplingParams())
    processor.add(good, arrival=0.0)
    processor.add(bad, arrival=0.0)
    done = processor.process(StepTokens([bad, good], [-1, 7], {}, time=1.0))  # the tokenizer cannot decode -1
    by_id = {o.request_id: o for o in done.outputs}
    assert by_id["bad"].finished and by_id["bad"].error and by_id["bad"].finish_reason is FinishReason.ABORT
    assert not by_id["good"].finished and by_id["good"].error is None
    assert done.to_finish == [("bad", RequestStatus.FINISHED_ABORTED)]


def test_an_engine_serves_a_new_core_after_the_last_one_stopped(engine):
    """An in-process core hands its engine back when it stops (its output sink closed): a second
    core on the same engine, from a new event loop, streams the same tokens, and so does the engine
    stepping on its own after that."""

    async def tokens() -> list[int]:
        client = EngineCoreClient.in_process(engine)
        got = [t async for out in client.generate(PROMPTS[0], _greedy()) for t in out.new_token_ids]
        await client.shutdown()
        return got

    first = asyncio.run(tokens())
    assert asyncio.run(tokens()) == first and len(first) == MAX_TOKENS
    assert [t for out in _inline(engine, [_greedy()] * len(PROMPTS))[0] for t in out.new_token_ids] == first
    assert _all_free(engine)


def _logprobs(outputs: list[RequestOutput]) -> list:
    return [lp for o in outputs for lp in (o.new_logprobs or ())]


def _sampled(**kwargs) -> SamplingParams:
    return SamplingParams(
        temperature=0.9,
        top_p=0.9,
        top_k=40,
        min_p=0.02,
        seed=2**64 - 7,
        repetition_penalty=1.3,
        presence_penalty=0.4,
        frequency_penalty=0.3,
        max_tokens=MAX_TOKENS,
        logprobs=2,
        **kwargs,
    )


@pytest.mark.parametrize("kind", ["greedy-stop-string", "seeded-penalties-logprobs"])
def test_a_migrated_stream_continues_exactly_where_the_client_left_it(engine, kind):
    """A Generate call with a Continuation (the gateway moved the stream after its worker failed) goes on
    from the client's tokens and text: the same tokens, text, logprobs, stop and usage as the stream
    that never moved, whatever token it was cut at (also inside text held back for a stop string)."""
    if kind == "greedy-stop-string":
        params = [dataclasses.replace(p, min_tokens=3) for p in _stop_strings(engine)]
    else:
        params = [_sampled() for _ in PROMPTS]
    want = _inline(engine, params)

    cases = [(i, cut) for i in range(len(PROMPTS)) for cut in sorted({1, 3, len(want[i]) // 2, len(want[i]) - 1})]
    cases = [(i, cut) for i, cut in cases if 0 < cut < len(want[i])]

    async def continued() -> list[list[RequestOutput]]:
        client = EngineCoreClient.in_process(engine)  # one worker takes every moved stream, one at a time
        got = []
        for i, cut in cases:
            had = want[i][:cut]  # what the client received before the worker failed (one token each inline)
            call = wpb.WorkerGenerateRequest(request_id=f"moved-{i}", prompt_token_ids=PROMPTS[i])
            call.params.CopyFrom(params_to_proto(params[i]))
            call.continuation.output_token_ids[:] = _tokens(had)
            call.continuation.num_text_chars = len(_text(had))
            got.append([out async for out in client.generate_call(call, params[i])])
        await client.shutdown()
        return got

    for (i, cut), got in zip(cases, asyncio.run(continued())):
        whole = want[i]
        assert _tokens(got) == _tokens(whole[cut:]), (i, cut)
        assert _text(whole[:cut]) + _text(got) == _text(whole), (i, cut)
        # The moved stream's prompt and tokens so far are computed in one pass, not token by token, so
        # logits may differ in the last float32 bits: logprobs close, token ids the same.
        for moved, unmoved in zip(_logprobs(got), _logprobs(whole[cut:]), strict=True):
            assert moved.token_id == unmoved.token_id and [t for t, _ in moved.top] == [t for t, _ in unmoved.top]
            assert moved.logprob == pytest.approx(unmoved.logprob, abs=1e-4), (i, cut)
        final, expected = got[-1], whole[-1]
        assert (final.finish_reason, final.stop_reason) == (expected.finish_reason, expected.stop_reason)
        assert (final.num_prompt_tokens, final.num_output_tokens) == (len(PROMPTS[i]), expected.num_output_tokens)
    assert len(cases) >= 12 and _all_free(engine)


def test_a_continuation_with_nothing_left_to_generate_is_refused(engine):
    async def main():
        client = EngineCoreClient.in_process(engine)
        call = wpb.WorkerGenerateRequest(prompt_token_ids=PROMPTS[0], params=params_to_proto(_greedy()))
        call.continuation.output_token_ids[:] = [5] * MAX_TOKENS
        try:
            return [out async for out in client.generate_call(call, _greedy())]
        finally:
            await client.shutdown()

    with pytest.raises(ValueError, match="nothing left to generate"):
        asyncio.run(main())
    assert _all_free(engine)
