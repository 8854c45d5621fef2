"""The prefill -> decode handoff between two in-process engine cores: the same cores, handoff tasks
and pipes as two workers' engine core processes, with the in-process transport and a direct call
instead of the Prefill RPC. Output must equal the unified engine's, token for token; failures fall
back without leaking blocks on either side."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import pytest
import torch

from splitserve.common.sampling_params import SamplingParams
from splitserve.common.security import OPEN_CLUSTER
from splitserve.common.wire import params_to_proto
from splitserve.protos.v1 import worker_pb2 as wpb
from splitserve.services.disagg.decode import CoreDecode, CoreDecodeSetup
from splitserve.services.disagg.handoff import (
    FirstToken,
    HandoffEvent,
    HandoffJob,
    PieceJob,
    PrefillClient,
    SendStarted,
)
from splitserve.services.disagg.plan import Piece
from splitserve.services.disagg.prefill import CorePrefillSetup
from splitserve.services.disagg.prefill_client import event_from_proto, job_to_proto
from splitserve.services.disagg.transfer.base import ChannelSpec, KVReceiver, KVSender, Moved
from splitserve.services.disagg.transfer.checksum import checksum
from splitserve.services.disagg.transfer.inprocess import Hub, InProcessReceiver, InProcessSender
from splitserve.services.engine.config import CacheConfig, EngineConfig
from splitserve.services.engine.core_client import CoreRefused, EngineCoreClient
from splitserve.services.engine.engine import Engine
from splitserve.services.engine.handoff_port import HandoffPort, engine_load
from splitserve.services.engine.llm import LLM
from splitserve.services.engine.step_loop import EngineDead
from splitserve.services.worker.server import _moving_kv

KV_BYTES = 2 * 1024**2


def _config(folder) -> EngineConfig:
    return EngineConfig(model=str(folder), max_model_len=256, cache=CacheConfig(block_size=8, kv_cache_bytes=KV_BYTES))


class DirectClient(PrefillClient):
    """The decode core's way to the prefill core: each Prefill call goes, as the decode core made it,
    to the prefill core's client on the test's event loop (as gRPC carries it to another process),
    and its events come back. Records every job it forwards and the kinds of event it relayed."""

    def __init__(self, prefills: dict[str, EngineCoreClient], loop: asyncio.AbstractEventLoop) -> None:
        self.prefills, self.loop = prefills, loop
        self.jobs: list[HandoffJob] = []
        self.events: list[type] = []  # the kinds of event each handoff yielded, in order
        self.fail_before_first = False
        self.before_failing: Callable[[], Awaitable[None]] | None = None  # awaited before failing

    async def prefill(self, peer: str, wire, job: HandoffJob) -> AsyncIterator[HandoffEvent]:
        self.jobs.append(job)
        if self.fail_before_first:
            if self.before_failing is not None:
                await self.before_failing()
            raise ConnectionError("prefill worker is gone")
        async for response in _across(self.loop, _prefill_call(self.prefills[peer], job_to_proto(job, wire))):
            event = event_from_proto(response)
            self.events.append(type(event))
            yield event


async def _prefill_call(prefill: EngineCoreClient, call: wpb.PrefillRequest) -> AsyncIterator[wpb.PrefillResponse]:
    """What the prefill worker's Prefill RPC streams (its responses as the core encoded them)."""
    try:
        async for event in prefill.prefill(call):
            yield wpb.PrefillResponse.FromString(event.response)
    except (CoreRefused, ValueError) as e:  # what the decode worker sees over gRPC: the Prefill RPC failed
        raise ConnectionError(f"the Prefill RPC failed: {e}") from e


async def _across(loop: asyncio.AbstractEventLoop, items: AsyncIterator) -> AsyncIterator:
    """items, iterated on loop (another thread's), yielded here; leaving early cancels it there."""
    here, queue = asyncio.get_running_loop(), asyncio.Queue()
    end = object()

    async def pump() -> None:
        try:
            async for item in items:
                here.call_soon_threadsafe(queue.put_nowait, item)
        except Exception as e:
            here.call_soon_threadsafe(queue.put_nowait, e)
        else:
            here.call_soon_threadsafe(queue.put_nowait, end)

    pumping = asyncio.run_coroutine_threadsafe(pump(), loop)
    try:
        while (item := await queue.get()) is not end:
            if isinstance(item, Exception):
                raise item
            yield item
    finally:
        pumping.cancel()


@dataclass(frozen=True)
class DecodeSetup(CoreDecodeSetup):
    """A decode core on the hub, reaching its prefill workers through client."""

    hub: Hub = field(default_factory=Hub)
    client: PrefillClient | None = None
    made: list[CoreDecode] = field(default_factory=list)  # the core's handoffs, once made

    def __call__(self, *args) -> CoreDecode:
        self.made.append(super().__call__(*args))
        return self.made[-1]

    def make_receiver(self, device: torch.device) -> KVReceiver:
        return InProcessReceiver(self.hub)

    def make_client(self) -> PrefillClient:
        assert self.client is not None
        return self.client


@dataclass(frozen=True)
class PrefillSetup(CorePrefillSetup):
    """A prefill core sending on the hub (or with a sender of the test's own)."""

    hub: Hub = field(default_factory=Hub)
    sender: KVSender | None = None

    def make_sender(self, device: torch.device) -> KVSender:
        return self.sender or InProcessSender(self.hub)


@pytest.fixture(scope="module")
def engines(tiny_llama_dir):
    return Engine(_config(tiny_llama_dir)), Engine(_config(tiny_llama_dir))


@dataclass
class Tiers:
    """A prefill core and a decode core (named p0 to it), on shared engines, in this event loop."""

    prefill: EngineCoreClient
    decode: EngineCoreClient
    client: DirectClient
    hub: Hub
    handoff: CoreDecode  # the decode core's handoffs

    async def close(self) -> None:
        await self.decode.shutdown()
        await self.prefill.shutdown()


def _tiers(
    engines, hub_timeout_s=5.0, send_delay_s=0.0, stream=False, wrap=lambda client: client, reserve_timeout_s=10.0
) -> Tiers:
    """wrap(client): the client the decode core uses (a test's, around the direct one)."""
    prefill_engine, decode_engine = engines
    hub = Hub(hub_timeout_s)
    prefill = EngineCoreClient.in_process(
        prefill_engine, PrefillSetup("127.0.0.1", hub_timeout_s, stream, send_delay_s, hub=hub)
    )
    client = DirectClient({"p0": prefill}, asyncio.get_running_loop())
    setup = DecodeSetup("127.0.0.1", hub_timeout_s, reserve_timeout_s, OPEN_CLUSTER, hub=hub, client=wrap(client))
    decode = EngineCoreClient.in_process(decode_engine, setup)
    return Tiers(prefill, decode, client, hub, setup.made[0])


def _generate(tiers: Tiers, prompt: list[int], params: SamplingParams, rid: str):
    call = wpb.WorkerGenerateRequest(
        request_id=rid, prompt_token_ids=prompt, params=params_to_proto(params), prefill_address="p0"
    )
    return tiers.decode.generate_call(call, params, rid)


async def _run(tiers: Tiers, prompt: list[int], params: SamplingParams, rid: str) -> list[int]:
    return [t async for out in _generate(tiers, prompt, params, rid) for t in out.new_token_ids]


def _all_free(engine: Engine) -> bool:
    return (
        engine.kv.num_free_blocks == engine.runner.num_blocks
        and not engine.has_unfinished_requests()
        and not engine.scheduler.held
        and not engine.kv.num_parked
    )


async def _settle(*engines: Engine) -> None:
    """Until every engine is free again (what the handoffs hold is released between steps)."""
    for _ in range(250):
        if all(_all_free(e) for e in engines):
            return
        await asyncio.sleep(0.02)


class StepGate:
    """engine.step, stopped once armed: the step thread sits in a step (as in a long forward) until
    opened."""

    def __init__(self, engine: Engine, monkeypatch) -> None:
        self.busy, self.opened, self.armed = threading.Event(), threading.Event(), False
        real = engine.step

        def step():
            if self.armed:
                self.armed = False
                self.busy.set()
                self.opened.wait(30)
            return real()

        monkeypatch.setattr(engine, "step", step)

    async def wait_busy(self) -> None:
        assert await asyncio.to_thread(self.busy.wait, 10), "the step thread never reached the gate"


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
        tiers = _tiers(engines, stream=stream)
        try:
            got = await asyncio.gather(*(_run(tiers, p, params, f"r{i}") for i, p in enumerate(PROMPTS)))
            await _settle(*engines)
        finally:
            await tiers.close()
        return got, tiers.client.events

    got, events = asyncio.run(main())
    assert got == want
    assert all(_all_free(e) for e in engines)
    assert events.count(SendStarted) == (len(PROMPTS) if stream else 0)


@pytest.mark.parametrize("stream", [False, True], ids=["after", "streamed"])
def test_shared_prefix_sends_fewer_blocks(engines, stream):
    params = SamplingParams(temperature=0.0, max_tokens=4)
    prefix = list(range(1 + 100 * stream, 41 + 100 * stream))  # 5 full blocks of 8, new to these engines

    async def main():
        tiers = _tiers(engines, stream=stream)
        try:
            await _run(tiers, prefix + [250, 251], params, "a")
            await _run(tiers, prefix + [260, 261, 262], params, "b")
            await _settle(*engines)
        finally:
            await tiers.close()
        return tiers.client.jobs

    first, second = asyncio.run(main())
    assert first.num_skip_blocks == 0
    assert second.num_skip_blocks == 5  # the decode worker already held the shared prefix


@pytest.mark.parametrize("stream", [False, True], ids=["after", "streamed"])
def test_transfer_timeout_falls_back_to_recompute(engines, tiny_llama_dir, stream):
    params = SamplingParams(temperature=0.0, max_tokens=8)
    want = LLM(_config(tiny_llama_dir)).generate([PROMPTS[3]], params)[0].token_ids

    async def main():
        tiers = _tiers(engines, hub_timeout_s=0.3, send_delay_s=0.6, stream=stream)
        try:
            got = await _run(tiers, PROMPTS[3], params, "slow")
            await _settle(*engines)  # the late send finds nobody and gives its blocks back
        finally:
            await tiers.close()
        return got

    assert asyncio.run(main()) == want
    assert all(_all_free(e) for e in engines)


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
        tiers = _tiers(engines, stream=stream)
        tiers.hub.tamper = tamper  # on the wire, after the sender's checksum
        try:
            got = await _run(tiers, prompt, params, "tampered")
            await _settle(*engines)
        finally:
            await tiers.close()
        return got

    with caplog.at_level("WARNING", logger="splitserve.decode"):
        got = asyncio.run(main())
    assert "KV checksum mismatch" in caplog.text  # rejected for its checksum, not for another reason
    assert got == want  # recomputed here: the corrupted blocks never reached the batch
    assert all(_all_free(e) for e in engines)


class MiscountingClient(PrefillClient):
    """A prefill worker whose first token announces one block more than its SendStarted did."""

    def __init__(self, inner: PrefillClient) -> None:
        self.inner = inner

    async def prefill(self, peer: str, wire, job: HandoffJob) -> AsyncIterator[HandoffEvent]:
        async for event in self.inner.prefill(peer, wire, job):
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
    port = HandoffPort  # counted on the class: CoreDecode's port and its RankReceivers' are one object
    acquire, release = port.acquire_staging, port.release_staging
    monkeypatch.setattr(port, "acquire_staging", lambda self, *a: staged.append(1) or acquire(self, *a))
    monkeypatch.setattr(port, "release_staging", lambda self, s: staged.append(-1) or release(self, s))

    async def main():
        tiers = _tiers(engines, stream=True, wrap=MiscountingClient)
        try:
            got = await _run(tiers, PROMPTS[3], params, "miscounted")
            await _settle(*engines)  # the streamed KV lands meanwhile, to be discarded
        finally:
            await tiers.close()
        return got

    assert asyncio.run(main()) == want  # recomputed on the decode worker
    assert all(_all_free(e) for e in engines)
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
        tiers = _tiers(engines, stream=True)
        try:
            with pytest.raises(CoreRefused) as info:
                await _run(tiers, PROMPTS[3], SamplingParams(max_tokens=4), "sf")
            await _settle(*engines)
        finally:
            await tiers.close()
        return info.value, tiers.client.events

    error, events = asyncio.run(main())
    assert error.code == "UNAVAILABLE" and error.failed_peer == "p0"
    assert events == [SendStarted]
    assert all(_all_free(e) for e in engines)


def test_failure_before_first_token_is_unavailable_and_frees_the_reservation(engines):
    async def main():
        tiers = _tiers(engines)
        tiers.client.fail_before_first = True
        try:
            with pytest.raises(CoreRefused) as info:
                await _run(tiers, PROMPTS[2], SamplingParams(max_tokens=4), "x")
            await _settle(engines[1])
        finally:
            await tiers.close()
        return info.value

    error = asyncio.run(main())
    assert error.code == "UNAVAILABLE" and error.failed_peer == "p0"
    assert _all_free(engines[1])


def test_a_failed_asks_reservation_is_kv_in_flight_until_freed(engines):
    """A drain waits for KV in flight. A failed ask leaves the landings at once, but its reservation is
    freed by an abort that runs between decode steps: until then the reservation still counts, or a
    drained worker exits with blocks reserved (seen in a scale-down under load)."""

    async def main() -> None:
        tiers = _tiers(engines)
        busy, opened = threading.Event(), threading.Event()

        def long_step() -> None:  # the decode step thread, in a step as the ask fails
            busy.set()
            opened.wait(30)

        async def block_decode_steps() -> None:
            tiers.handoff.steps.post(long_step)
            await asyncio.to_thread(busy.wait, 10)

        tiers.client.fail_before_first, tiers.client.before_failing = True, block_decode_steps
        try:
            with pytest.raises(CoreRefused):
                await _run(tiers, PROMPTS[2], SamplingParams(max_tokens=4), "f")
            assert not tiers.handoff.landings and tiers.decode.num_requests() == 0
            assert _moving_kv(engine_load(engines[1])), "a drain would stop with the failed ask's blocks reserved"
            opened.set()
            await _settle(engines[1])
            assert _all_free(engines[1]) and not _moving_kv(engine_load(engines[1]))
        finally:
            opened.set()
            await tiers.close()

    asyncio.run(main())


def test_a_cancelled_request_keeps_its_blocks_out_of_the_pool_until_its_kv_stops_landing(engines):
    """Rank 0 writes each chunk into the reserved blocks as it lands (not between steps), so the
    blocks of a request cancelled mid-transfer are parked, not freed, until the receive ends:
    freed at once, another request could get them and have its KV overwritten."""
    decode_engine = engines[1]

    async def main():
        tiers = _tiers(engines, send_delay_s=0.5)
        try:
            free_before = decode_engine.kv.num_free_blocks
            stream = _generate(tiers, PROMPTS[4], SamplingParams(max_tokens=50), "k")
            await anext(stream)  # the first token is out; the blocks are still on their way
            await stream.aclose()
            await tiers.decode.drain_kv_events()  # a query after the abort: the abort has run
            assert not decode_engine.scheduler.requests and decode_engine.kv.is_parked("k")
            assert decode_engine.kv.num_free_blocks < free_before
            assert engine_load(decode_engine).num_awaiting_kv == 1  # a drain still waits for it
            await _settle(*engines)
        finally:
            await tiers.close()

    asyncio.run(main())
    assert all(_all_free(e) for e in engines) and not decode_engine.kv.is_parked("k")


@pytest.mark.parametrize("stream", [False, True], ids=["after", "streamed"])
def test_cancel_during_transfer_frees_both_sides(engines, stream):
    async def main():
        tiers = _tiers(engines, send_delay_s=0.3, stream=stream)
        try:
            outputs = _generate(tiers, PROMPTS[4], SamplingParams(max_tokens=50), "c")
            await anext(outputs)  # the first token is out; the blocks are still on their way
            await outputs.aclose()
            await _settle(*engines)
        finally:
            await tiers.close()

    asyncio.run(main())
    assert all(_all_free(e) for e in engines)


class _NeverJoins(KVSender):
    """A send to a receiver that never comes (a rendezvous nobody hosts): it waits in its join until
    cancelled, touching no block."""

    def __init__(self) -> None:
        self.cancelled = threading.Event()

    def connect(self, channel: ChannelSpec) -> None:
        pass

    async def send(self, channel: ChannelSpec, tag: int, blocks: torch.Tensor, fill=None) -> Moved:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        raise AssertionError("unreachable")


@pytest.mark.parametrize("stream", [False, True], ids=["after", "streamed"])
def test_a_prefill_call_that_is_gone_ends_its_waiting_send_and_frees_the_held_blocks(engines, stream):
    """An aborted Prefill call (Worker.Abort by the client's id, or its decode worker gone) whose
    send still waits to join its channel ends that send and frees the prompt's held blocks at once,
    not when the join times out (30 s and more: TCPStore retries a dead address)."""
    prefill_engine = engines[0]
    sender = _NeverJoins()

    async def main():
        prefill = EngineCoreClient.in_process(prefill_engine, PrefillSetup("127.0.0.1", 5.0, stream, sender=sender))
        channel = InProcessReceiver(Hub()).channel_for("p0")
        heads = range(prefill_engine.runner.arch.num_kv_heads)
        job = HandoffJob((PieceJob(Piece(0, 0, heads), channel, 1),), 0, prefill_engine.runner.kv_layout)
        params = SamplingParams(max_tokens=50)
        wire = wpb.WorkerGenerateRequest(request_id="gone", prompt_token_ids=PROMPTS[4], params=params_to_proto(params))
        try:
            events = _prefill_call(prefill, job_to_proto(job, wire))
            async for response in events:
                if response.HasField("first_token"):
                    break  # the prompt is computed; its blocks are held for the send
            assert prefill_engine.num_held_blocks() > 0
            await events.aclose()  # the call is gone
            assert await asyncio.to_thread(sender.cancelled.wait, 10), "the waiting send was not ended"
            await _settle(prefill_engine)
        finally:
            await prefill.shutdown()

    asyncio.run(main())
    assert _all_free(prefill_engine)


def test_received_blocks_are_bit_identical(engines):
    prefill_engine, decode_engine = engines
    runner = prefill_engine.runner
    with torch.no_grad():
        runner.kv_cache[:, :, 3:6].normal_()
    heads = range(runner.arch.num_kv_heads)  # every head: whole blocks
    sent = runner.read_heads([3, 4, 5], heads)

    async def main():
        hub = Hub()
        receiver, sender = InProcessReceiver(hub), InProcessSender(hub)
        channel = receiver.channel_for("p0")
        buffer = decode_engine.runner.staging.acquire(3).tensor
        await asyncio.gather(receiver.recv(channel, 1, buffer), sender.send(channel, 1, sent))
        return buffer

    received = asyncio.run(main())
    decode_engine.runner.write_heads([7, 9, 11], heads, received)
    assert torch.equal(decode_engine.runner.read_heads([7, 9, 11], heads), sent)
    assert checksum(received) == checksum(sent)
    # the blocks written here may have held cached prefixes: forget them, or later tests read garbage
    assert prefill_engine.kv.pool.reset_prefix_cache() and decode_engine.kv.pool.reset_prefix_cache()


class _StuckSteps:
    """The step loop of an engine whose step thread is in a long step (a prefill forward, seconds on
    a CPU): calls between steps never come back."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    async def call(self, fn, *args):
        await asyncio.Event().wait()

    def post(self, fn, *args) -> None:
        pass


def test_the_sender_claims_held_blocks_while_a_step_runs(tiny_llama_dir):
    """The claim does not wait for the step thread: on a CPU the next prompt's forward takes seconds,
    and waiting for it delayed every handoff (seen as a second token seconds after the first)."""
    engine = Engine(_config(tiny_llama_dir))
    request = engine.make_request(
        [1, 2, 3, 4, 5], SamplingParams(temperature=0.0, max_tokens=4), stop_after_prefill=True
    )
    engine.add_request(request)
    while engine.has_unfinished_requests():
        engine.step()  # finished at its first token, blocks held under a lease
    port = HandoffPort(_StuckSteps(engine))  # type: ignore[arg-type]

    async def main() -> None:
        assert await asyncio.wait_for(port.claim_held(request.request_id), 5)
        assert not await asyncio.wait_for(port.claim_held(request.request_id), 5)  # claimed once

    asyncio.run(main())
    assert engine.release_held(request.request_id)


def test_the_second_token_does_not_wait_for_the_prefill_workers_step(engines, monkeypatch):
    """Once the KV is sent, the decode worker gets TransferDone and lands it while the prefill worker's
    step thread is busy (its next prompt's forward, seconds on a CPU). Releasing the sent blocks waits
    for that step; TransferDone waiting for the release delayed the second token by a whole prefill step."""
    gate = StepGate(engines[0], monkeypatch)

    async def main() -> None:
        tiers = _tiers(engines, send_delay_s=0.3)  # the send starts 0.3 s after the claim
        try:
            stream = _generate(tiers, PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=4), "s")
            await anext(stream)  # the first token: the send has not started yet (send_delay_s)
            gate.armed = True  # the prefill worker's next prompt: its step sits at the gate
            other = asyncio.ensure_future(_drain(tiers.prefill.generate(PROMPTS[1], SamplingParams(max_tokens=1))))
            await gate.wait_busy()
            try:
                second = await asyncio.wait_for(anext(stream), 10)
                assert second.new_token_ids
            finally:
                gate.opened.set()
            await other
            async for _ in stream:
                pass
            await _settle(*engines)
        finally:
            gate.opened.set()
            await tiers.close()

    asyncio.run(main())
    assert all(_all_free(e) for e in engines)


async def _drain(outputs: AsyncIterator) -> None:
    async for _ in outputs:
        pass


def test_a_prefill_core_stopped_with_a_send_in_flight_leaves_no_block_held(engines):
    """The core stops while a Prefill call's send has claimed the held blocks: the send is ended with
    the handoffs and its release still runs, so the engine a later core steps holds nothing."""
    prefill_engine = engines[0]

    async def main():
        prefill = EngineCoreClient.in_process(prefill_engine, PrefillSetup("127.0.0.1", 5.0, False, 30.0))
        channel = InProcessReceiver(Hub()).channel_for("p0")
        heads = range(prefill_engine.runner.arch.num_kv_heads)
        job = HandoffJob((PieceJob(Piece(0, 0, heads), channel, 1),), 0, prefill_engine.runner.kv_layout)
        params = SamplingParams(max_tokens=50)
        wire = wpb.WorkerGenerateRequest(request_id="cut", prompt_token_ids=PROMPTS[3], params=params_to_proto(params))
        events = _prefill_call(prefill, job_to_proto(job, wire))
        async for response in events:
            if response.HasField("first_token"):
                break  # the send claimed the blocks and waits (send_delay_s)
        assert prefill_engine.num_held_blocks() > 0
        await prefill.shutdown()
        with pytest.raises(EngineDead):  # the call ends with the core
            await anext(events)

    asyncio.run(main())
    assert _all_free(prefill_engine)


def _fill(engine: Engine) -> list[str]:
    """On the step loop: one-block reservations until the pool takes no more (what a busy decode
    worker's requests in flight hold); their ids."""
    ids = []
    while True:
        i = len(ids)
        filler = engine.make_request([i % 300 + 1, i // 300 + 1, *range(2, 8)], SamplingParams(max_tokens=1))
        if engine.scheduler.reserve_for_transfer(filler) is None:
            return ids
        ids.append(filler.request_id)


async def _until(condition: Callable[[], bool]) -> None:
    for _ in range(500):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the state was never reached")


def test_a_handoff_without_room_waits_in_the_scheduler_until_blocks_are_freed(engines, tiny_llama_dir):
    """A full decode worker queues the handoff's reservation (awaiting_room) instead of refusing or
    polling it; the blocks freed by the next abort make it, and the output is the unified engine's."""
    params = SamplingParams(temperature=0.0, max_tokens=6)
    want = LLM(_config(tiny_llama_dir)).generate([PROMPTS[2]], params)[0].token_ids
    decode_engine = engines[1]

    async def main():
        tiers = _tiers(engines)
        try:
            fillers = await tiers.handoff.steps.call(_fill, decode_engine)
            run = asyncio.ensure_future(_run(tiers, PROMPTS[2], params, "q"))
            await _until(lambda: "q" in decode_engine.scheduler.awaiting_room)
            assert not tiers.client.jobs  # no Prefill call before the blocks are reserved
            for rid in fillers:
                tiers.decode.abort(rid)  # through the core, as a cancelled stream's abort
            got = await asyncio.wait_for(run, 30)
            await _settle(*engines)
        finally:
            await tiers.close()
        return got

    assert asyncio.run(main()) == want
    assert all(_all_free(e) for e in engines) and not decode_engine.scheduler.awaiting_room


def test_a_reservation_that_never_gets_room_is_refused_and_leaves_the_queue(engines):
    decode_engine = engines[1]

    async def main():
        tiers = _tiers(engines, reserve_timeout_s=0.5)
        try:
            fillers = await tiers.handoff.steps.call(_fill, decode_engine)
            with pytest.raises(CoreRefused) as info:
                await _run(tiers, PROMPTS[2], SamplingParams(max_tokens=4), "never")
            await tiers.decode.drain_kv_events()  # a query after the handoff's end: its abort has run
            assert not decode_engine.scheduler.awaiting_room
            for rid in fillers:
                tiers.decode.abort(rid)
            await _settle(decode_engine)
        finally:
            await tiers.close()
        return info.value

    error = asyncio.run(main())
    assert error.code == "RESOURCE_EXHAUSTED" and "no room" in error.message
    assert not error.failed_peer  # no prefill worker is blamed: none was asked
    assert _all_free(decode_engine)
