"""The engine core in its own process (services/engine/core_process.py) behind EngineCoreClient: the same
outputs as the engine stepped in process (LLM), refusals that leave it serving, aborts that free
blocks, and a dead core that fails every stream instead of hanging it. Real spawned processes and pipes."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time

import pytest
import torch

from splitserve.common.sampling_params import SamplingParams
from splitserve.protos.v1 import engine_core_pb2 as pb
from splitserve.services.engine.config import CacheConfig, EngineConfig
from splitserve.services.engine.core_client import EngineCoreClient
from splitserve.services.engine.llm import LLM, CompletionOutput
from splitserve.services.engine.outputs import RequestOutput
from splitserve.services.engine.request import FinishReason
from splitserve.services.engine.step_loop import EngineDead
from splitserve.services.engine.step_stats import StepKind


def _config(model_dir) -> EngineConfig:
    return EngineConfig(
        model=str(model_dir), max_model_len=256, cache=CacheConfig(block_size=8, kv_cache_bytes=2 * 1024**2)
    )


PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20], [21]]
PARAMS = [
    SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=9, logprobs=2, ignore_eos=True),
    SamplingParams(temperature=0.8, seed=7, max_tokens=10, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=1),
]


async def _collect(stream) -> list[RequestOutput]:
    return [out async for out in stream]


async def _run_all(engine) -> list[list[RequestOutput]]:
    return await asyncio.gather(*(_collect(engine.generate(p, s, label="x")) for p, s in zip(PROMPTS, PARAMS)))


def _joined(outs: list[RequestOutput]) -> tuple:
    last = outs[-1]
    ids = [t for o in outs for t in o.new_token_ids]
    logprobs = [lp for o in outs for lp in (o.new_logprobs or [])]
    return ids, "".join(o.new_text for o in outs), last.finish_reason, last.num_output_tokens, logprobs


def _completed(out: CompletionOutput) -> tuple:
    """An LLM's output as _joined gives a stream's."""
    return out.token_ids, out.text, out.finish_reason, len(out.token_ids), out.logprobs or []


def test_core_process_serves_like_the_engine_in_process(tiny_llama_dir):
    config = _config(tiny_llama_dir)
    with LLM(config) as llm:
        expected = [_completed(out) for out in llm.generate(PROMPTS, PARAMS)]
        # a stop string from the middle of a greedy output: it ends the request, in both, alike
        stop = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[expected[0][1][3:6]])
        stopped = _completed(llm.generate(PROMPTS[0], stop)[0])
    assert stopped[2] is FinishReason.STOP and stopped[3] < 12 and stopped[1] == expected[0][1][:3]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # what --num-threads 1 does: the core runs its CPU ops on as many threads
    try:
        client = EngineCoreClient.launch(config)
    finally:
        torch.set_num_threads(threads)
    assert client.num_threads == 1

    async def main() -> None:
        client.start()
        assert _joined(await _collect(client.generate(PROMPTS[0], stop))) == stopped
        got = await _run_all(client)
        for outs, (ids, text, reason, n, logprobs) in zip(got, expected):
            g_ids, g_text, g_reason, g_n, g_logprobs = _joined(outs)
            assert (g_ids, g_text, g_reason, g_n) == (ids, text, reason, n)
            assert [lp.token_id for lp in g_logprobs] == [lp.token_id for lp in logprobs]
            assert [lp.logprob for lp in g_logprobs] == pytest.approx([lp.logprob for lp in logprobs], abs=1e-5)

        # refused, here or by the core, and the core serves on
        for prompt, params in (([1, 99999], SamplingParams()), ([1] * 200, SamplingParams(max_tokens=100))):
            with pytest.raises(ValueError):
                await _collect(client.generate(prompt, params))
        with pytest.raises(ValueError):
            await _collect(client.generate([-1], SamplingParams()))
        assert _joined(await _collect(client.generate(PROMPTS[0], PARAMS[0])))[0] == expected[0][0]
        assert len(expected[0][0]) == 12 and len(expected[1][4]) == 9 and expected[2][0] != expected[0][0]

        # a consumer that leaves early aborts its request: it stops soon, and every block comes back
        before = client.load().steps
        stream = client.generate([3, 4, 5], SamplingParams(temperature=0, max_tokens=240, ignore_eos=True))
        await anext(stream)
        await stream.aclose()
        await _collect(client.generate([9], PARAMS[3]))  # commands apply in order: the abort came first
        load = await _settled(client, before[StepKind.PREFILL].num_steps + 2)
        assert load.num_running == 0 and load.num_free_blocks == load.num_total_blocks
        decoded = load.steps[StepKind.DECODE].num_tokens - before[StepKind.DECODE].num_tokens
        assert decoded < 100  # not run to its 240 tokens

        # an abort by the client's id (the Abort RPC) ends the stream with finish reason abort
        stream = client.generate([5, 6], SamplingParams(temperature=0, max_tokens=240, ignore_eos=True), label="lbl")
        await anext(stream)
        assert client.abort_label("lbl") == 1
        last = (await asyncio.wait_for(_collect(stream), 10))[-1]
        assert last.finished and last.finish_reason is FinishReason.ABORT and last.num_output_tokens < 100

        # the prefix index's snapshot: the prompts' full blocks are cached
        hashes, _ = await client.kv_snapshot()
        assert len(hashes) >= 1
        await client.shutdown()

    asyncio.run(main())
    assert client.exitcode == 0 and not client.died.is_set()


async def _settled(client: EngineCoreClient, num_prefill_steps: int, timeout_s: float = 30.0):
    """The first load reported with that many prefill steps and nothing running (the core sends its
    step totals within 100 ms of a change)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        load = client.load()
        done = load.steps[StepKind.PREFILL].num_steps >= num_prefill_steps and load.num_running == 0
        if done or asyncio.get_running_loop().time() > deadline:
            return load
        await asyncio.sleep(0.02)


def test_the_load_is_current_when_a_stream_ends(tiny_llama_dir):
    """What a GetLoad or a metrics scrape reads right after a client's stream ended (or got its first
    token) is the state after that step, not one up to a load-clock tick old.

    At the first token the request may already have finished (the core steps on while this loop
    waits to run), so that load is checked for having scheduled it (its prompt's tokens were looked
    up in the prefix cache), not for it running."""
    client = EngineCoreClient.launch(_config(tiny_llama_dir))

    async def main() -> None:
        client.start()
        seen = []
        for i in range(6):
            before = client.load().prefix_cache_queries
            stream = client.generate([1 + i, 2, 3], SamplingParams(temperature=0, max_tokens=3 + i, ignore_eos=True))
            await anext(stream)
            running = client.load()
            await _collect(stream)
            done = client.load()
            scheduled = running.prefix_cache_queries - before
            seen.append((scheduled, done.num_running, done.num_total_blocks - done.num_free_blocks))
        await client.shutdown()
        assert seen == [(3, 0, 0)] * 6

    asyncio.run(main())


def test_a_dead_core_fails_every_stream_and_sets_died(tiny_llama_dir):
    client = EngineCoreClient.launch(_config(tiny_llama_dir))

    async def main() -> None:
        client.start()
        params = SamplingParams(temperature=0, max_tokens=240, ignore_eos=True)
        streams = [client.generate([i + 1, i + 2], params) for i in range(3)]
        for stream in streams:
            await anext(stream)
        os.kill(client.pid, signal.SIGKILL)
        for stream in streams:
            with pytest.raises(EngineDead):
                await _collect(stream)
        await asyncio.wait_for(client.died.wait(), 10)
        with pytest.raises(EngineDead):
            await _collect(client.generate([1], params))
        with pytest.raises(EngineDead):
            await client.drain_kv_events()

    asyncio.run(main())
    assert client.exitcode == -signal.SIGKILL


def test_a_seed_of_2_to_the_63_or_more_samples_in_a_core_as_in_process(tiny_llama_dir):
    """Issue 43 item 5: the core's seed was int64, so every seed >= 2^63 (and so every negative HTTP
    seed, which the gateway wraps into uint64) was refused on the default path. The same tokens as
    the engine in process, for seeds on both sides of 2^63."""
    config = _config(tiny_llama_dir)
    # (torch's CPU generator keeps a seed's low 32 bits: these differ there, so they sample apart)
    seeds = [2**63, 2**63 + 1, 2**64 - 2, 2**64 - 1, 12345]
    prompts = [[3, 4, 5, 6] for _ in seeds]

    def params(seed: int) -> SamplingParams:
        return SamplingParams(temperature=1.0, seed=seed, max_tokens=16, ignore_eos=True)

    async def sample(client: EngineCoreClient) -> list[list[int]]:
        client.start()
        outs = await asyncio.gather(*(_collect(client.generate(p, params(s))) for p, s in zip(prompts, seeds)))
        await client.shutdown()
        return [_joined(o)[0] for o in outs]

    with LLM(config) as llm:
        expected = [out.token_ids for out in llm.generate(prompts, [params(s) for s in seeds])]
    assert len({tuple(ids) for ids in expected}) == len(seeds)  # the seeds sample apart
    assert asyncio.run(sample(EngineCoreClient.launch(config))) == expected


def _stuck_transfer_thread(engine) -> None:
    """A prepare hook (run in the core): an executor thread stuck for a minute, as a gloo connect to a
    dead peer is until its timeout."""
    from concurrent.futures import ThreadPoolExecutor

    ThreadPoolExecutor(1).submit(time.sleep, 60)


def test_an_orphaned_core_exits_at_once_even_with_a_transfer_thread_stuck(tiny_llama_dir):
    """The fault suite saw a killed prefill worker's core outlive it by 25 s: the core stopped serving
    when its pipe closed, then its interpreter's exit waited for a transfer thread blocked on a dead
    peer. The core exits once it has stopped, whatever its threads do."""
    import multiprocessing

    from splitserve.services.engine.core_process import run_engine_core

    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    args = (_config(tiny_llama_dir), theirs, logging.INFO, _stuck_transfer_thread)
    core = context.Process(target=run_engine_core, args=args)
    core.start()
    theirs.close()
    try:
        assert pb.CoreEvent.FromString(ours.recv_bytes()).WhichOneof("event") == "ready"
        ours.close()  # the serving process is gone
        core.join(15)
        assert core.exitcode == 0, "the core outlived its serving process"
    finally:
        core.kill()
