"""The prefill -> decode handoff in one process: two engines, the in-process transport and direct
calls instead of gRPC. Output must equal the unified engine's, token for token; failures fall
back without leaking blocks on either side."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
import pytest
import torch

from splitserve.common.sampling_params import SamplingParams
from splitserve.services.disagg.decode import DecodeHandoff
from splitserve.services.disagg.handoff import (
    FirstToken,
    HandoffError,
    HandoffEvent,
    HandoffJob,
    PrefillClient,
    SendStarted,
)
from splitserve.services.disagg.prefill import prefill_and_send
from splitserve.services.disagg.rank_transfers import RankReceivers
from splitserve.services.disagg.transfer.base import ChannelSpec, KVSender, Moved
from splitserve.services.disagg.transfer.checksum import checksum
from splitserve.services.disagg.transfer.inprocess import Hub, InProcessReceiver, InProcessSender
from splitserve.services.engine.async_engine import AsyncEngine, RequestFailed
from splitserve.services.engine.config import CacheConfig, EngineConfig
from splitserve.services.engine.engine import Engine
from splitserve.services.engine.handoff_port import HandoffPort
from splitserve.services.engine.llm import LLM
from splitserve.services.engine.request import Request
from splitserve.services.worker.server import _moving_kv

KV_BYTES = 2 * 1024**2


def _config(folder) -> EngineConfig:
    return EngineConfig(model=str(folder), max_model_len=256, cache=CacheConfig(block_size=8, kv_cache_bytes=KV_BYTES))


class DirectClient(PrefillClient):
    """Calls prefill_and_send on in-process prefill engines; records every job it forwards."""

    def __init__(
        self, prefills: dict[str, AsyncEngine], hub: Hub, send_delay_s: float = 0.0, stream: bool = False
    ) -> None:
        self.prefills, self.sender, self.send_delay_s = prefills, InProcessSender(hub), send_delay_s
        self.stream = stream  # the KV sent layer by layer while the last prompt chunk computes
        self.jobs: list[HandoffJob] = []
        self.events: list[type] = []  # the kinds of event each handoff yielded, in order
        self.fail_before_first = False
        self.before_failing: Callable[[], Awaitable[None]] | None = None  # awaited before failing

    async def prefill(self, peer: str, request: Request, wire, job: HandoffJob) -> AsyncIterator[HandoffEvent]:
        self.jobs.append(job)
        if self.fail_before_first:
            if self.before_failing is not None:
                await self.before_failing()
            raise ConnectionError("prefill worker is gone")
        engine = self.prefills[peer]
        copy = HandoffPort(engine).make_prefill_request(
            request.all_token_ids, request.sampling_params, label=request.request_id
        )
        events = prefill_and_send(engine, copy, self.sender, job, send_delay_s=self.send_delay_s, stream=self.stream)
        try:
            async for event in events:
                self.events.append(type(event))
                yield event
        except RequestFailed as e:  # what the decode worker sees over gRPC: the Prefill RPC failed
            raise ConnectionError(f"the Prefill RPC failed: {e}") from e


@pytest.fixture(scope="module")
def engines(tiny_llama_dir):
    return Engine(_config(tiny_llama_dir)), Engine(_config(tiny_llama_dir))


def _setup(engines, hub_timeout_s=5.0, send_delay_s=0.0, stream=False):
    prefill_engine, decode_engine = engines
    prefill, decode = AsyncEngine(prefill_engine), AsyncEngine(decode_engine)
    hub = Hub(hub_timeout_s)
    client = DirectClient({"p0": prefill}, hub, send_delay_s, stream)
    handoff = DecodeHandoff(decode, InProcessReceiver(hub), client, transfer_timeout_s=hub_timeout_s)
    return prefill, decode, client, handoff


async def _run(handoff: DecodeHandoff, prompt: list[int], params: SamplingParams, rid: str) -> list[int]:
    request = handoff.engine.engine.make_request(prompt, params, rid)
    tokens: list[int] = []
    async for out in handoff.generate(request, "p0"):
        tokens.extend(out.new_token_ids)
    return tokens


def _all_free(engine: Engine) -> bool:
    return (
        engine.kv.num_free_blocks == engine.runner.num_blocks
        and not engine.has_unfinished_requests()
        and not engine.scheduler.held
    )


async def _settle(*engines: AsyncEngine) -> None:
    for _ in range(100):
        if all(_all_free(e.engine) for e in engines):
            return
        await asyncio.sleep(0.02)


PROMPTS = [[(5 * i + j) % 300 + 1 for j in range(3 + 11 * i)] for i in range(5)]  # 3..47 tokens, ragged


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, max_tokens=12),
        SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=12),
        SamplingParams(temperature=0.0, max_tokens=12, repetition_penalty=1.3, presence_penalty=0.5),
    ],
    ids=["greedy", "seeded", "penalties"],
)
@pytest.mark.parametrize("stream", [False, True], ids=["after", "streamed"])
def test_disaggregated_output_equals_unified(engines, tiny_llama_dir, params, stream):
    want = [o.token_ids for o in LLM(_config(tiny_llama_dir)).generate(PROMPTS, params)]

    async def main():
        prefill, decode, client, handoff = _setup(engines, stream=stream)
        got = await asyncio.gather(*(_run(handoff, p, params, f"r{i}") for i, p in enumerate(PROMPTS)))
        await _settle(prefill, decode)
        return got, prefill, decode, client.events

    got, prefill, decode, events = asyncio.run(main())
    assert got == want
    assert _all_free(prefill.engine) and _all_free(decode.engine)
    assert events.count(SendStarted) == (len(PROMPTS) if stream else 0)


@pytest.mark.parametrize("stream", [False, True], ids=["after", "streamed"])
def test_shared_prefix_sends_fewer_blocks(engines, stream):
    params = SamplingParams(temperature=0.0, max_tokens=4)
    prefix = list(range(1 + 100 * stream, 41 + 100 * stream))  # 5 full blocks of 8, new to these engines

    async def main():
        prefill, decode, client, handoff = _setup(engines, stream=stream)
        await _run(handoff, prefix + [250, 251], params, "a")
        await _run(handoff, prefix + [260, 261, 262], params, "b")
        await _settle(prefill, decode)
        return client.jobs

    first, second = asyncio.run(main())
    assert first.num_skip_blocks == 0
    assert second.num_skip_blocks == 5  # the decode worker already held the shared prefix


@pytest.mark.parametrize("stream", [False, True], ids=["after", "streamed"])
def test_transfer_timeout_falls_back_to_recompute(engines, tiny_llama_dir, stream):
    params = SamplingParams(temperature=0.0, max_tokens=8)
    want = LLM(_config(tiny_llama_dir)).generate([PROMPTS[3]], params)[0].token_ids

    async def main():
        prefill, decode, _, handoff = _setup(engines, hub_timeout_s=0.3, send_delay_s=0.6, stream=stream)
        got = await _run(handoff, PROMPTS[3], params, "slow")
        await asyncio.sleep(0.7)  # the late send finds nobody and gives its blocks back
        await _settle(prefill, decode)
        return got, prefill, decode

    got, prefill, decode = asyncio.run(main())
    assert got == want
    assert _all_free(prefill.engine) and _all_free(decode.engine)


def _flip_one_bit(wire: torch.Tensor) -> None:
    wire.view(torch.uint8).view(-1)[1000] ^= 1


def _swap_two_blocks(wire: torch.Tensor) -> None:  # the right bytes in the wrong places (misrouted)
    wire[:, :, [0, 1]] = wire[:, :, [1, 0]].clone()


@pytest.mark.parametrize(
    ("tamper", "seed", "stream"),
    [(_flip_one_bit, 1, False), (_swap_two_blocks, 2, False), (_flip_one_bit, 3, True)],
    ids=["bit-flipped", "blocks-swapped", "bit-flipped-streamed"],
)
def test_a_corrupted_transfer_fails_its_checksum_and_the_prompt_is_recomputed(
    engines, tiny_llama_dir, tamper, seed, stream, caplog
):
    params = SamplingParams(temperature=0.0, max_tokens=8)
    prompt = [(13 * j + 7 * seed) % 290 + 1 for j in range(36)]  # 5 blocks, none cached by earlier tests
    want = LLM(_config(tiny_llama_dir)).generate([prompt], params)[0].token_ids

    async def main():
        prefill, decode, client, handoff = _setup(engines, stream=stream)
        client.sender.hub.tamper = tamper  # on the wire, after the sender's checksum
        got = await _run(handoff, prompt, params, "tampered")
        await _settle(prefill, decode)
        return got, prefill, decode

    with caplog.at_level("WARNING", logger="splitserve.decode"):
        got, prefill, decode = asyncio.run(main())
    assert "KV checksum mismatch" in caplog.text  # rejected for its checksum, not for another reason
    assert got == want  # recomputed here: the corrupted blocks never reached the batch
    assert _all_free(prefill.engine) and _all_free(decode.engine)


class MiscountingClient(PrefillClient):
    """A prefill worker whose first token announces one block more than its SendStarted did."""

    def __init__(self, inner: PrefillClient) -> None:
        self.inner = inner

    async def prefill(self, peer: str, request: Request, wire, job: HandoffJob) -> AsyncIterator[HandoffEvent]:
        async for event in self.inner.prefill(peer, request, wire, job):
            yield (
                dataclasses.replace(event, num_blocks=event.num_blocks + 1) if isinstance(event, FirstToken) else event
            )


def test_a_streamed_handoff_whose_counts_disagree_recomputes_and_releases_what_landed(
    engines, tiny_llama_dir, monkeypatch
):
    """The receives posted on SendStarted are discarded when the first token's count then disagrees:
    the prompt is recomputed here and every staging buffer the landing took goes back."""
    params = SamplingParams(temperature=0.0, max_tokens=6)
    want = LLM(_config(tiny_llama_dir)).generate([PROMPTS[3]], params)[0].token_ids
    staged: list[int] = []
    port = HandoffPort  # counted on the class: DecodeHandoff's port and its RankReceivers' are one object
    acquire, release = port.acquire_staging, port.release_staging
    monkeypatch.setattr(port, "acquire_staging", lambda self, *a: staged.append(1) or acquire(self, *a))
    monkeypatch.setattr(port, "release_staging", lambda self, s: staged.append(-1) or release(self, s))

    async def main():
        prefill, decode, client, handoff = _setup(engines, stream=True)
        handoff.client = MiscountingClient(client)
        got = await _run(handoff, PROMPTS[3], params, "miscounted")
        await asyncio.sleep(0.2)  # the streamed KV lands meanwhile, to be discarded
        await _settle(prefill, decode)
        return got, prefill, decode

    got, prefill, decode = asyncio.run(main())
    assert got == want  # recomputed on the decode worker
    assert _all_free(prefill.engine) and _all_free(decode.engine)
    assert staged.count(1) >= 1 and sum(staged) == 0, "a staging buffer of the discarded landing was kept"


def test_a_failed_streamed_step_is_unavailable_and_frees_both_sides(engines, monkeypatch):
    """The prefill step computing a streamed prompt fails after SendStarted: the receives already
    posted fail with the send, the client gets UNAVAILABLE (retried elsewhere), nothing leaks."""
    layer = engines[0].runner.model.layers[-1]
    real = layer.forward

    def broken(*args, **kwargs):
        monkeypatch.setattr(layer, "forward", real)  # once
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(layer, "forward", broken)

    async def main():
        prefill, decode, client, handoff = _setup(engines, stream=True)
        with pytest.raises(HandoffError) as info:
            await _run(handoff, PROMPTS[3], SamplingParams(max_tokens=4), "sf")
        await _settle(prefill, decode)
        return info.value, prefill, decode, client.events

    error, prefill, decode, events = asyncio.run(main())
    assert error.code == grpc.StatusCode.UNAVAILABLE and error.failed_peer == "p0"
    assert events == [SendStarted]
    assert _all_free(prefill.engine) and _all_free(decode.engine)


def test_failure_before_first_token_is_unavailable_and_frees_the_reservation(engines):
    async def main():
        prefill, decode, client, handoff = _setup(engines)
        client.fail_before_first = True
        with pytest.raises(HandoffError) as info:
            await _run(handoff, PROMPTS[2], SamplingParams(max_tokens=4), "x")
        await _settle(prefill, decode)
        return info.value, decode

    error, decode = asyncio.run(main())
    assert error.code == grpc.StatusCode.UNAVAILABLE and error.failed_peer == "p0"
    assert _all_free(decode.engine)


def test_a_failed_asks_reservation_is_kv_in_flight_until_freed(engines):
    """A drain waits for KV in flight. A failed ask leaves the landings at once, but its reservation is
    freed by an abort that runs between decode steps: until then the reservation still counts, or a
    drained worker exits with blocks reserved (seen in a scale-down under load)."""
    import threading

    async def main() -> None:
        prefill, decode, client, handoff = _setup(engines)
        busy, release = threading.Event(), threading.Event()

        def long_step() -> None:  # the decode step thread, in a step as the ask fails
            busy.set()
            release.wait(30)

        async def block_decode_steps() -> None:
            nonlocal stuck
            stuck = asyncio.ensure_future(decode.call(long_step))
            await asyncio.to_thread(busy.wait, 10)

        stuck: asyncio.Future | None = None
        client.fail_before_first, client.before_failing = True, block_decode_steps
        try:
            with pytest.raises(HandoffError):
                await _run(handoff, PROMPTS[2], SamplingParams(max_tokens=4), "f")
            assert not handoff.landings and decode.num_requests() == 0
            assert _moving_kv(handoff.port.load()), "a drain would stop with the failed ask's blocks still reserved"
        finally:
            release.set()
        await stuck
        await _settle(prefill, decode)
        assert _all_free(decode.engine) and not _moving_kv(handoff.port.load())

    asyncio.run(main())


def test_a_cancelled_request_keeps_its_blocks_out_of_the_pool_until_its_kv_stops_landing(engines):
    """Rank 0 writes each chunk into the reserved blocks as it lands (not between steps), so the
    blocks of a request cancelled mid-transfer are parked, not freed, until the receive ends:
    freed at once, another request could get them and have its KV overwritten."""

    async def main():
        prefill, decode, _, handoff = _setup(engines, send_delay_s=0.5)
        free_before = decode.engine.kv.num_free_blocks
        request = decode.engine.make_request(PROMPTS[4], SamplingParams(max_tokens=50), "k")
        stream = handoff.generate(request, "p0")
        await anext(stream)  # the first token is out; the blocks are still on their way
        await stream.aclose()
        await decode.call(lambda: None)  # the abort has run
        assert not decode.engine.scheduler.requests and decode.engine.kv.is_parked("k")
        assert decode.engine.kv.num_free_blocks < free_before
        assert handoff.port.load().num_awaiting_kv == 1  # a drain still waits for it
        await asyncio.sleep(1.0)
        await _settle(prefill, decode)
        return prefill, decode

    prefill, decode = asyncio.run(main())
    assert _all_free(prefill.engine) and _all_free(decode.engine) and not decode.engine.kv.is_parked("k")


@pytest.mark.parametrize("stream", [False, True], ids=["after", "streamed"])
def test_cancel_during_transfer_frees_both_sides(engines, stream):
    async def main():
        prefill, decode, _, handoff = _setup(engines, send_delay_s=0.3, stream=stream)
        request = decode.engine.make_request(PROMPTS[4], SamplingParams(max_tokens=50), "c")
        outputs = handoff.generate(request, "p0")
        await anext(outputs)  # the first token is out; the blocks are still on their way
        await outputs.aclose()
        await asyncio.sleep(0.5)
        await _settle(prefill, decode)
        return prefill, decode

    prefill, decode = asyncio.run(main())
    assert _all_free(prefill.engine) and _all_free(decode.engine)


class _NeverJoins(KVSender):
    """A send to a receiver that never comes (a rendezvous nobody hosts): it waits in its join until
    cancelled, touching no block."""

    def __init__(self) -> None:
        self.cancelled = False

    def connect(self, channel: ChannelSpec) -> None:
        pass

    async def send(self, channel: ChannelSpec, tag: int, blocks: torch.Tensor, fill=None) -> Moved:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        raise AssertionError("unreachable")


@pytest.mark.parametrize("stream", [False, True], ids=["after", "streamed"])
def test_a_prefill_call_that_is_gone_ends_its_waiting_send_and_frees_the_held_blocks(engines, stream):
    """An aborted Prefill call (Worker.Abort by the client's id, or its decode worker gone) whose
    send still waits to join its channel ends that send and frees the prompt's held blocks at once,
    not when the join times out (30 s and more: TCPStore retries a dead address)."""

    async def main():
        prefill, decode, _, _ = _setup(engines)
        pieces = await RankReceivers(InProcessReceiver(Hub()), HandoffPort(decode)).plan("p0", 1)
        job = HandoffJob(pieces, 0, HandoffPort(decode).kv_layout)
        request = HandoffPort(prefill).make_prefill_request(PROMPTS[4], SamplingParams(max_tokens=50), label="gone")
        sender, first = _NeverJoins(), asyncio.Event()

        async def call() -> None:
            async for event in prefill_and_send(prefill, request, sender, job, stream=stream):
                if isinstance(event, FirstToken):
                    first.set()

        task = asyncio.create_task(call())
        await first.wait()  # the prompt is computed; its blocks are held for the send
        assert prefill.engine.num_held_blocks() > 0
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await _settle(prefill)
        return prefill, sender.cancelled  # read now: asyncio.run cancels whatever is left when main returns

    prefill, send_ended = asyncio.run(main())
    assert send_ended and _all_free(prefill.engine)


def test_received_blocks_are_bit_identical(engines):
    prefill_engine, decode_engine = engines
    runner = prefill_engine.runner
    with torch.no_grad():
        runner.kv_cache[:, :, 3:6].normal_()
    sent = runner.read_blocks([3, 4, 5])

    async def main():
        hub = Hub()
        receiver, sender = InProcessReceiver(hub), InProcessSender(hub)
        channel = receiver.channel_for("p0")
        buffer = decode_engine.runner.staging.acquire(3).tensor
        await asyncio.gather(receiver.recv(channel, 1, buffer), sender.send(channel, 1, sent))
        return buffer

    received = asyncio.run(main())
    decode_engine.runner.write_blocks([7, 9, 11], received)
    assert torch.equal(decode_engine.runner.read_blocks([7, 9, 11]), sent)
    assert checksum(received) == checksum(sent)


def test_the_sender_claims_held_blocks_while_a_step_runs(tiny_llama_dir):
    """The claim does not wait for the step thread: on a CPU the next prompt's forward takes seconds,
    and waiting for it delayed every handoff (seen as a second token seconds after the first)."""
    import threading

    async def main() -> None:
        engine = AsyncEngine(Engine(_config(tiny_llama_dir)))
        port = HandoffPort(engine)
        request = port.make_prefill_request([1, 2, 3, 4, 5], SamplingParams(temperature=0.0, max_tokens=4))
        async for _ in engine.generate_request(request):
            pass  # finished at its first token, blocks held under a lease
        busy, release = threading.Event(), threading.Event()

        def long_step() -> None:  # the step thread, stuck as in a long forward
            busy.set()
            release.wait(30)

        stuck = asyncio.ensure_future(engine.call(long_step))
        await asyncio.to_thread(busy.wait, 10)
        try:
            assert await asyncio.wait_for(port.claim_held(request.request_id), 5)
            assert not await asyncio.wait_for(port.claim_held(request.request_id), 5)  # claimed once
        finally:
            release.set()
            await stuck
        assert await port.release_held(request.request_id)
        await engine.shutdown()

    asyncio.run(main())


def test_the_second_token_does_not_wait_for_the_prefill_workers_step(engines):
    """Once the KV is sent, the decode worker gets TransferDone and lands it while the prefill worker's
    step thread is busy (its next prompt's forward, seconds on a CPU). Releasing the sent blocks waits
    for that step; TransferDone waiting for the release delayed the second token by a whole prefill step."""
    import threading

    async def main() -> None:
        prefill, decode, _, handoff = _setup(engines, send_delay_s=0.3)  # the send starts 0.3 s after the claim
        request = decode.engine.make_request(PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=4), "s")
        stream = handoff.generate(request, "p0")
        busy, release = threading.Event(), threading.Event()

        def long_step() -> None:  # the prefill step thread, stuck as in the next prompt's forward
            busy.set()
            release.wait(30)

        try:
            await anext(stream)  # the first token: the send has not started yet (send_delay_s)
            stuck = asyncio.ensure_future(prefill.call(long_step))
            await asyncio.to_thread(busy.wait, 10)
            second = await asyncio.wait_for(anext(stream), 10)
            assert second.new_token_ids
        finally:
            release.set()
        await stuck
        async for _ in stream:
            pass
        await _settle(prefill, decode)
        assert _all_free(prefill.engine) and _all_free(decode.engine)

    asyncio.run(main())
