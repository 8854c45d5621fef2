"""Engine, LLM and the engine core client (in process) on the tiny Llama: validation, abort, streaming,
sampling."""

from __future__ import annotations

import asyncio

import pytest

from splitserve.common.sampling_params import SamplingParams
from splitserve.services.engine.config import CacheConfig, EngineConfig
from splitserve.services.engine.core_client import EngineCoreClient
from splitserve.services.engine.engine import Engine
from splitserve.services.engine.llm import LLM
from splitserve.services.engine.request import FinishReason


@pytest.fixture(scope="module")
def engine(tiny_llama_dir) -> Engine:
    return Engine(
        EngineConfig(
            model=str(tiny_llama_dir), max_model_len=256, cache=CacheConfig(block_size=8, kv_cache_bytes=2 * 1024**2)
        )
    )


def _all_free(engine: Engine) -> bool:
    return engine.kv.num_free_blocks == engine.runner.num_blocks and not engine.has_unfinished_requests()


@pytest.mark.parametrize(
    "prompt, params, message",
    [
        ("", SamplingParams(), "prompt is empty"),
        ([], SamplingParams(), "prompt is empty"),
        ([1] * 300, SamplingParams(), "model context is 256"),
        ([1] * 200, SamplingParams(max_tokens=100), "exceeds the model context"),
        ([1, 99999], SamplingParams(), "token ids must be in"),
    ],
)
def test_bad_input_is_rejected_without_leaks(engine, prompt, params, message):
    with pytest.raises(ValueError, match=message):
        engine.add_request(prompt, params)
    assert _all_free(engine)


@pytest.mark.parametrize(
    "kwargs",
    [dict(max_tokens=0), dict(max_tokens=-3), dict(top_p=0.0), dict(top_p=1.5), dict(stop=5), dict(stop=[1, 2])],
)
def test_bad_sampling_params_raise_value_error(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_request_that_can_never_fit_is_rejected(tiny_llama_dir):
    cache = CacheConfig(block_size=8, kv_cache_bytes=8 * 4096)  # 4 KiB per block
    small = Engine(EngineConfig(model=str(tiny_llama_dir), cache=cache))
    assert small.runtime.kv_capacity_tokens == 64
    with pytest.raises(ValueError, match="can never fit the KV cache"):
        small.add_request([1] * 40, SamplingParams(max_tokens=30))
    assert _all_free(small)


def test_abort_frees_blocks_at_once(engine):
    rid = engine.add_request([3] * 50, SamplingParams(temperature=0, max_tokens=100))
    engine.step()
    assert engine.kv.num_free_blocks < engine.runner.num_blocks
    assert engine.abort_request(rid)
    assert _all_free(engine)
    assert not engine.abort_request(rid)


def test_seeded_sampling_does_not_depend_on_batch(engine):
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=20)
    llm = LLM.__new__(LLM)
    llm.engine, llm.tokenizer = engine, engine.tokenizer
    alone = llm.generate([[5, 6, 7, 8]], params)[0].token_ids
    others = SamplingParams(temperature=1.0, seed=7, max_tokens=30)
    batched = llm.generate([[9] * 20, [5, 6, 7, 8], [1, 2, 3]], [others, params, others])
    assert batched[1].token_ids == alone
    unseeded = llm.generate([[5, 6, 7, 8]] * 2, SamplingParams(temperature=1.0, max_tokens=20))
    assert unseeded[0].token_ids != unseeded[1].token_ids  # the shared generator moves on


def test_logprobs_and_stop_token(engine):
    llm = LLM.__new__(LLM)
    llm.engine, llm.tokenizer = engine, engine.tokenizer
    first = llm.generate([[4, 4, 4]], SamplingParams(temperature=0, max_tokens=8, logprobs=3))[0]
    assert len(first.logprobs) == 8
    for token, lp in zip(first.token_ids, first.logprobs):
        assert lp.token_id == token and lp.top[0][0] == token  # greedy picks the top logprob
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)
    stop_at = first.token_ids[3]
    stopped = llm.generate([[4, 4, 4]], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop_at]))[0]
    cut = first.token_ids.index(stop_at) + 1
    assert stopped.token_ids == first.token_ids[:cut]
    assert stopped.finish_reason.value == "stop" and stopped.stop_reason == stop_at


def test_a_core_client_streams_and_cancel_frees_blocks(engine):
    async def main():
        client = EngineCoreClient.in_process(engine)
        params = SamplingParams(temperature=0, max_tokens=12)
        chunks = [o async for o in client.generate([7, 8, 9], params, request_id="full")]
        assert sum(len(c.new_token_ids) for c in chunks) == 12 and chunks[-1].finished

        async def consume_two():
            gen = client.generate([1] * 30, SamplingParams(temperature=0, max_tokens=200), request_id="cut")
            n = 0
            async for _ in gen:
                n += 1
                if n == 2:
                    await asyncio.sleep(10)  # cancelled here

        task = asyncio.create_task(consume_two())
        await asyncio.sleep(0.3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(100):  # the loop applies the abort between steps
            if _all_free(engine):
                break
            await asyncio.sleep(0.02)
        await client.shutdown()

    asyncio.run(main())
    assert _all_free(engine)


def test_abort_by_the_clients_id_ends_its_streams(engine):
    """The Abort RPC's path (abort_label): each stream with that label ends with finish reason abort
    and the tokens it got (it hung before: nothing ever reached it again), and its blocks are freed."""

    async def main():
        client = EngineCoreClient.in_process(engine)
        params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        streams = [client.generate([i + 1, 2, 3], params, label="lbl") for i in range(2)]
        firsts = [await anext(s) for s in streams]
        assert client.abort_label("lbl") == 2
        for first, stream in zip(firsts, streams):
            rest = await asyncio.wait_for(_drain(stream), 10)
            last = rest[-1]
            assert last.finished and last.finish_reason is FinishReason.ABORT and len(rest) < 100
            assert last.num_output_tokens == len(first.new_token_ids) + sum(len(o.new_token_ids) for o in rest)
        await client.shutdown()

    asyncio.run(main())
    assert _all_free(engine)


async def _drain(stream) -> list:
    return [out async for out in stream]


def test_a_core_client_rejects_bad_input(engine):
    async def main():
        client = EngineCoreClient.in_process(engine)
        with pytest.raises(ValueError, match="prompt is empty"):
            async for _ in client.generate([], SamplingParams()):
                pass
        await client.shutdown()

    asyncio.run(main())
    assert _all_free(engine)


def test_a_core_client_merges_outputs_when_the_consumer_falls_behind(engine):
    async def main():
        client = EngineCoreClient.in_process(engine)
        chunks = []
        async for out in client.generate([2, 3, 4], SamplingParams(temperature=0, max_tokens=24)):
            chunks.append(out)
            await asyncio.sleep(0.2)  # a slow client: several steps queue up meanwhile
        await client.shutdown()
        return chunks

    chunks = asyncio.run(main())
    tokens = [t for c in chunks for t in c.new_token_ids]
    assert len(tokens) == 24 and len(chunks) < 24  # nothing lost, fewer messages
    assert chunks[-1].finished and chunks[-1].num_output_tokens == 24
    assert "".join(c.new_text for c in chunks) == engine.tokenizer.decode(tokens)
