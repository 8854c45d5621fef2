"""Decode tier: continue requests whose prompt KV comes from a prefill worker.

Lifecycle of a request here: awaiting_room -> awaiting_kv -> waiting -> running -> finished (the
whole handoff, both sides and every failure, is described once, in services/disagg/handoff.py).

In the engine core process (CoreDecodeSetup, CoreDecode, below): the serving process keeps the per-
stream work (the gRPC streams, detokenization, stop strings); the core steps and, on a thread of its own
with an asyncio loop, runs each request's handoff (CoreDecode.hand_off: reserve, the Prefill RPC, the KV
receives into the reserved blocks, the first token, the landing), so the KV never leaves the process
that owns the cache. The first token goes to the serving process like a step's
tokens; the request joins the batch once its KV landed and streams from then on like any other.

What crosses the pipe (services/engine/core_process.py): the Generate call as the worker received it,
its prefill_address naming the prefill worker (the call goes on to it as it is); an abort, which cancels a handoff still
in flight (whatever the prefill worker announced is still received and dropped) and aborts the
request in the engine; a refusal with a status code and the prefill worker to blame when the
handoff cannot start (RESOURCE_EXHAUSTED: no room for the prompt's KV; UNAVAILABLE: the prefill
worker failed before the first token), which the serving process returns to the gateway as it
would its own HandoffError.

The handoff's metrics are counted here, in the core's registry (services/disagg/metrics.py), which
the worker's scrapes read; its times are stamped on the request by the engine where each happens and
ride its step tokens (HandoffTimes: the request's stage timings); its spans join the request's trace
(services/disagg/core_handoffs.py, which also holds the thread). A
tensor-parallel decode worker's follower ranks are the core's children: the core opens their KV
endpoints and orders their receives, as a serving process does in one process.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import grpc
import torch
from prometheus_client import CollectorRegistry

from splitserve.common.security import ClusterSecurity
from splitserve.common.tracing import fail, stage
from splitserve.protos.v1 import engine_core_pb2 as cpb
from splitserve.protos.v1 import worker_pb2 as pb
from splitserve.services.disagg.core_handoffs import CoreLoop
from splitserve.services.disagg.handoff import (
    FirstToken,
    HandoffError,
    HandoffJob,
    HandoffProtocolError,
    PrefillClient,
    SendStarted,
    TransferDone,
)
from splitserve.services.disagg.metrics import KVTransferMetrics
from splitserve.services.disagg.prefill_client import GrpcPrefillClient
from splitserve.services.disagg.rank_transfers import Endpoint, RankReceivers, Received, open_rank_endpoints
from splitserve.services.disagg.transfer.base import Backend, KVReceiver, TransferError, TransferFailure
from splitserve.services.disagg.transfer.isolated import make_receiver
from splitserve.services.engine.core_process import Send, refusal
from splitserve.services.engine.engine import Engine
from splitserve.services.engine.handoff_port import HandoffPort, Reservation
from splitserve.services.engine.outputs import StepTokens
from splitserve.services.engine.request import Request
from splitserve.services.engine.step_loop import StepLoop

log = logging.getLogger("splitserve.decode")

# What a prefill worker's failure looks like from here: its RPC failed, it timed out, its stream
# ended early, its events broke the protocol, or the transport failed. Anything else is a bug.
PREFILL_FAILURES = (
    grpc.aio.AioRpcError,
    TimeoutError,
    StopAsyncIteration,
    ConnectionError,
    HandoffProtocolError,
    TransferError,
)


@dataclass(frozen=True, slots=True)
class Receiving:
    """A handoff's receives, posted (rank 0's piece first pinned its blocks)."""

    num_blocks: int
    recvs: Sequence[asyncio.Future[Received]]

    def discard(self, discard_landed: Callable[[asyncio.Future], None]) -> None:
        """The handoff failed: whatever lands is released uncommitted."""
        for recv in self.recvs:
            recv.add_done_callback(discard_landed)


def _check_num_blocks(num_blocks: int, reservation: Reservation) -> None:
    if num_blocks != reservation.num_blocks_to_land:
        raise HandoffProtocolError(
            f"the prefill worker announced {num_blocks} blocks, {reservation.num_blocks_to_land} were reserved"
        )


def _check_pieces(job: HandoffJob, done: TransferDone, received: list[Received]) -> None:
    """Every piece's checksum as its rank received it equals the sender's (a mismatch: recompute)."""
    if received and len(done.checksums) != len(received):
        counts = f"{len(done.checksums)} checksums for {len(received)} pieces"
        raise HandoffProtocolError(f"the transfer report has {counts}")
    for piece, r, crc in zip(job.pieces, received, done.checksums):
        if r.report.checksum != crc:
            raise TransferError(TransferFailure.CHECKSUM, f"KV checksum mismatch on transfer {piece.tag}")


def _consume_error(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()


def _describe(e: BaseException) -> str:
    if isinstance(e, grpc.aio.AioRpcError):
        return f"{e.code().name}: {e.details()}"
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


@dataclass(frozen=True)
class CoreDecodeSetup:
    """What the spawn hands the core to make its handoffs (services/engine/core_process.py HandoffsSetup)."""

    host: str  # where the KV receiver's TCPStore listens (the worker's advertised host)
    transfer_timeout_s: float
    reserve_timeout_s: float
    cluster: ClusterSecurity  # the Prefill RPC's credentials
    metric_labels: Mapping[str, str] = field(default_factory=dict)  # the worker's, on every series

    def __call__(self, engine: Engine, steps: StepLoop, send: Send, registry: CollectorRegistry) -> CoreDecode:
        return CoreDecode(self, engine, steps, send, KVTransferMetrics(self.metric_labels, "decode", registry))

    def make_receiver(self, device: torch.device) -> KVReceiver:
        """The core's KV receiver (tests give their own transport, and their own make_client)."""
        receiver = make_receiver(self.host, self.transfer_timeout_s, device)
        log.info("KV channels meet at TCPStore %s (in the engine core)", receiver.address)
        return receiver

    def make_client(self) -> PrefillClient:
        """How the core reaches prefill workers: their Prefill RPC."""
        return GrpcPrefillClient(self.cluster.worker_channel)


class CoreDecode:
    """The core's handoffs (services/engine/core_process.py CoreHandoffs), one task each on the handoff loop."""

    def __init__(
        self, setup: CoreDecodeSetup, engine: Engine, steps: StepLoop, send: Send, metrics: KVTransferMetrics
    ) -> None:
        self.steps, self._send, self.metrics = steps, send, metrics
        self.port = HandoffPort(steps)
        self._peer_sizes: dict[str, int] = {}  # prefill workers' tensor-parallel sizes, asked once
        self.reserve_timeout_s = setup.reserve_timeout_s
        self.transfer_timeout_s = setup.transfer_timeout_s
        # Asks and transfers in flight, each holding a reservation (a drain waits for them).
        self.landings: set[asyncio.Task] = set()
        self._loop = CoreLoop("core-handoffs", engine, self.port.device)
        self.receiver, self.client, self.ranks = self._loop.run(self._connect(setup))

    async def _connect(self, setup: CoreDecodeSetup) -> tuple[KVReceiver, PrefillClient, RankReceivers]:
        """On the handoff loop: the KV receiver, the way to prefill workers, this worker's receiving ranks."""
        receiver = setup.make_receiver(self.port.device)
        # follower ranks (children of this core) receive their own KV heads on endpoints of their own
        await open_rank_endpoints(self.port, Endpoint.RECEIVER, setup.host, setup.transfer_timeout_s)
        return receiver, setup.make_client(), RankReceivers(receiver, self.port)

    def start(self, request: Request, add: cpb.CoreAddRequest) -> None:
        rid = request.request_id
        if not add.HasField("generate"):
            self._send(refusal(rid, "a decode worker's engine core runs no Prefill calls", "FAILED_PRECONDITION"))
            return
        call = add.generate
        self._loop.start_task(rid, lambda: self._hand_off(request, call.prefill_address, call), add.trace_context)

    def on_step(self, step: StepTokens) -> None:
        pass  # every output of a decode worker is made in its serving process

    def close(self) -> None:
        async def close() -> None:
            self.receiver.close()
            await self.client.close()

        self._loop.close(close)

    # -- on the handoff loop ------------------------------------------------------------------------
    async def _hand_off(self, request: Request, peer: str, wire: pb.WorkerGenerateRequest) -> None:
        rid = request.request_id
        try:
            await self.hand_off(request, peer, wire)
        except HandoffError as e:
            self._end(rid)
            self._send(refusal(rid, e.message, e.code.name, e.failed_peer or ""))
        except asyncio.CancelledError:  # aborted by the serving process (its stream is gone)
            self._end(rid)
        except Exception as e:  # a bug: this request ends, the core serves on
            log.exception("request %s: the handoff failed", rid)
            self._end(rid)
            self._send(refusal(rid, f"the KV handoff failed ({type(e).__name__}: {e})", "INTERNAL"))

    def _end(self, request_id: str) -> None:
        """The handoff ended before the first token: whatever it reserved goes (an abort between steps,
        after the reserve if that came first; a no-op if nothing was reserved)."""
        self.steps.post(self.steps.engine.abort_request, request_id)

    async def hand_off(self, request: Request, peer: str, wire: pb.WorkerGenerateRequest) -> asyncio.Task[None]:
        """Reserve, ask the prefill worker, start the landing and accept the first token (it goes
        out like a step's tokens); returns the landing (it ends when the KV landed; the engine
        stamps the request's times, its stages, where each happens). Raises HandoffError if the
        handoff cannot start; a caller cancelled before the first token still receives whatever
        the prefill worker announced, and drops it."""
        with stage("decode.reserve") as span:  # waiting for room in the KV cache
            reservation = await self._reserve(request)
            span.set_attributes(
                {
                    "splitserve.num_held_blocks": reservation.num_held_blocks,  # prefix hits: not sent
                    "splitserve.num_blocks_to_land": reservation.num_blocks_to_land,
                }
            )
        ask = asyncio.create_task(self._ask(reservation, peer, wire))
        self.landings.add(ask)  # its reservation is in flight too: a drain waits for it
        try:
            first, job, events, receiving = await asyncio.shield(ask)
        except asyncio.CancelledError:  # still take what the prefill worker sends, then drop it
            ask.add_done_callback(lambda task: self._land_if_asked(reservation, task))
            raise
        finally:
            if ask.done():  # else _land_if_asked lets go of it, once its landing (if any) is tracked
                self.landings.discard(ask)
        landing = self._start_landing(reservation, first, job, events, receiving)
        prefill_ms = (first.queue_ms, first.compute_ms)
        await self.port.accept_first_token(reservation, first.token_id, first.logprobs, prefill_ms)
        return landing

    def _land_if_asked(self, reservation: Reservation, ask: asyncio.Task) -> None:
        """The caller left while asking; if the blocks were announced anyway, receive and discard them."""
        if not ask.cancelled() and ask.exception() is None:
            self._start_landing(reservation, *ask.result())
        self.landings.discard(ask)

    def _start_landing(
        self, reservation: Reservation, first: FirstToken, job: HandoffJob, events, receiving: Receiving | None
    ) -> asyncio.Task:
        landing = asyncio.create_task(self._land(reservation, job, first, events, receiving))
        self.landings.add(landing)
        landing.add_done_callback(self.landings.discard)
        return landing

    async def _reserve(self, request: Request) -> Reservation:
        """Queued in the engine until the pool has room (the handoff's end withdraws it)."""
        try:
            reservation = await asyncio.wait_for(self.port.reserve(request), self.reserve_timeout_s)
        except TimeoutError:
            raise HandoffError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"this decode worker's KV cache had no room "
                f"for the {request.num_prompt_tokens}-token prompt for "
                f"{self.reserve_timeout_s:.0f} s; retry later or add decode workers",
            ) from None
        if reservation.num_held_blocks:
            self.metrics.observe_blocks_skipped(reservation.num_held_blocks)
        return reservation

    async def _ask(self, reservation: Reservation, peer: str, wire: pb.WorkerGenerateRequest):
        job: HandoffJob | None = None
        try:
            job = await self._job(reservation, peer)
            events = aiter(self.client.prefill(peer, wire, job))
            first, receiving = await self._first_token(reservation, job, events)
        except HandoffError:
            self._forget(peer, job)
            raise
        except PREFILL_FAILURES as e:
            self._forget(peer, job)
            self.metrics.observe_transfer_failure(TransferFailure.PREFILL_FAILED)
            raise HandoffError(
                grpc.StatusCode.UNAVAILABLE,
                f"prefill worker {peer} failed before the first token ({_describe(e)}); retry the request",
                failed_peer=peer,
            ) from None
        return first, job, events, receiving

    async def _first_token(
        self, reservation: Reservation, job: HandoffJob, events
    ) -> tuple[FirstToken, Receiving | None]:
        """The prefill worker's first token; if it streams the KV (SendStarted first), with the
        receives posted on SendStarted, so the KV lands while its last layers still compute."""
        first = await asyncio.wait_for(anext(events), self.transfer_timeout_s * 4)
        receiving = None
        if isinstance(first, SendStarted):
            _check_num_blocks(first.num_blocks, reservation)
            if first.num_blocks:
                receiving = self._post_receives(reservation, job, first.num_blocks)
        try:
            if isinstance(first, SendStarted):
                first = await asyncio.wait_for(anext(events), self.transfer_timeout_s * 4)
            if not isinstance(first, FirstToken):
                raise HandoffProtocolError(f"expected the first token, got {type(first).__name__}")
        except BaseException:
            if receiving is not None:  # they end with the failed send (or time out), then are discarded
                receiving.discard(self._discard_landed)
            raise
        return first, receiving

    async def _job(self, reservation: Reservation, peer: str) -> HandoffJob:
        size = self._peer_sizes.get(peer)
        if size is None:
            size = self._peer_sizes[peer] = await self.client.tensor_parallel_size(peer)
        pieces = await self.ranks.plan(peer, size)
        return HandoffJob(pieces, reservation.num_held_blocks, self.port.kv_layout, self.port.tensor_parallel_size)

    def _forget(self, peer: str, job: HandoffJob | None) -> None:
        """Before the first token: the peer's size is asked again next time, the job's channels dropped."""
        self._peer_sizes.pop(peer, None)
        for piece in job.pieces if job is not None else ():
            self.ranks.drop(piece)

    async def _land(
        self, reservation: Reservation, job: HandoffJob, first: FirstToken, events, receiving: Receiving | None
    ) -> None:
        """Receive every piece (posted already when streamed) and admit the request, or fall back to
        recomputing the prompt here; under the landing's span (a child of the request's: this task
        inherits its context)."""
        rid = reservation.request.request_id
        with stage("decode.kv_transfer", {"splitserve.num_blocks": first.num_blocks}) as span:
            try:
                if receiving is not None and receiving.num_blocks != first.num_blocks:
                    receiving.discard(self._discard_landed)
                    streamed = f"{receiving.num_blocks} blocks were streamed, {first.num_blocks} announced"
                    raise HandoffProtocolError(streamed)
                _check_num_blocks(first.num_blocks, reservation)  # a streamed count was checked at SendStarted
                if receiving is None and first.num_blocks:
                    receiving = self._post_receives(reservation, job, first.num_blocks)
                done, received = await self._receive(job, events, receiving)
                admitted = await self._admit(reservation, job, done, received)
                num_bytes, seconds = self._observe_received(done, received)
                log.debug("request %s: %d blocks landed (admitted=%s)", rid, done.num_blocks, admitted)
                span.set_attributes({"splitserve.num_bytes": num_bytes, "splitserve.transfer_ms": seconds * 1e3})
            except PREFILL_FAILURES as e:
                fail(span, f"KV transfer failed: {_describe(e)}")
                reason = e.reason if isinstance(e, TransferError) else TransferFailure.PREFILL_FAILED
                if reason.drops_channel:
                    for piece in job.pieces:
                        self.ranks.drop(piece)
                self.metrics.observe_transfer_failure(reason)
                if await self.port.recompute(reservation):
                    span.set_attribute("splitserve.recomputed", True)
                    log.warning("request %s: KV transfer failed (%s); recomputing the prompt here", rid, _describe(e))
                    self.metrics.observe_recompute_fallback()

    async def _admit(
        self, reservation: Reservation, job: HandoffJob, done: TransferDone, received: list[Received]
    ) -> bool:
        """Every checksum checked, every rank writes its pieces (between steps), then the request joins the batch."""
        try:
            _check_pieces(job, done, received)
            admitted = await self.port.land(reservation, [r.piece for r in received])
        except BaseException:
            for r in received:
                self.ranks.release(r, committed=False)
            raise
        for r in received:
            self.ranks.release(r, committed=admitted)
        return admitted

    def _observe_received(self, done: TransferDone, received: list[Received]) -> tuple[int, float]:
        """(bytes, seconds) of the pieces every rank received (the slowest piece's time), counted."""
        num_bytes = sum(r.report.num_bytes for r in received)
        seconds = max((r.report.seconds for r in received), default=0.0)
        self.metrics.observe_transfer("received", done.num_blocks, num_bytes, seconds)
        for r in received:
            self.metrics.observe_rank_bytes("received", r.piece.rank, r.report.num_bytes)
        return num_bytes, seconds

    def _post_receives(self, reservation: Reservation, job: HandoffJob, num_blocks: int) -> Receiving:
        """Every piece's receive, posted. Rank 0's piece is written into the reserved blocks chunk by
        chunk as it lands (pinned until every receive has ended, whatever ends the reservation first)."""
        pinned = self.port.pin(reservation)  # None: the request is gone; its pieces land to be discarded
        recvs = [asyncio.ensure_future(self.ranks.recv(piece, num_blocks, pinned)) for piece in job.pieces]
        if pinned is not None:
            ended = asyncio.gather(*recvs, return_exceptions=True)
            ended.add_done_callback(lambda _: self.port.unpin_soon(reservation))
        return Receiving(num_blocks, recvs)

    async def _receive(
        self, job: HandoffJob, events, receiving: Receiving | None
    ) -> tuple[TransferDone, list[Received]]:
        """Await the posted receives and read the sender's report together; the first failure wins
        (pieces that land anyway are discarded). None posted: nothing moves."""
        if receiving is None:
            self._skip(job)
            return await anext(events), []
        recvs = receiving.recvs
        report = asyncio.ensure_future(asyncio.wait_for(anext(events), self.transfer_timeout_s * 2))
        try:
            await asyncio.wait({*recvs, report}, return_when=asyncio.FIRST_EXCEPTION)
            for task in (*recvs, report):
                error = task.exception() if task.done() else None
                if error is not None:
                    raise error
            done = report.result()
            if not isinstance(done, TransferDone):
                raise HandoffProtocolError(f"expected the transfer report, got {type(done).__name__}")
            return done, [recv.result() for recv in recvs]
        except BaseException:
            receiving.discard(self._discard_landed)
            raise
        finally:
            if not report.done():
                report.cancel()
            report.add_done_callback(_consume_error)

    def _skip(self, job: HandoffJob) -> None:
        """No piece moves: an NCCL channel, whose transfers go in tag order, would wait for these tags
        forever, so it is dropped (the next handoff names a new one); a gloo channel is unaffected."""
        for piece in job.pieces:
            if piece.channel.backend is Backend.NCCL:
                self.ranks.drop(piece)

    def _discard_landed(self, recv: asyncio.Future) -> None:
        if not recv.cancelled() and recv.exception() is None:
            self.ranks.release(recv.result(), committed=False)
