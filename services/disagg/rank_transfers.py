"""KV handoffs rank to rank: each rank of a tensor-parallel worker sends or receives the KV heads it
holds (a piece, services/disagg/plan.py) on a transport endpoint of its own; nothing is gathered through
rank 0. Rank 0 moves its own pieces with the worker's KVReceiver / KVSender and gives its followers
orders over their pipes (services/engine/ranks.py; rank 0 reaches them through HandoffPort).

Lifecycle of a piece on a follower (RankAgent, its transfer thread):
    decode:  KV_CHANNEL (its channel to a prefill rank, cached by rank 0) -> RECV_KV (into a staging
             buffer; reply: bytes, checksum) -> landed -> COMMIT_KV (on the step loop, between steps:
             written into the cache) or DISCARD_KV (the handoff failed or the request is gone)
    prefill: CONNECT_KV (join the channel while the prompt computes) -> SEND_KV (read its heads of
             the held blocks as they are sent; reply: bytes, checksum), or STREAM_KV before the
             step that computes them (each layer read once that step on this rank has written it);
             rank 0 releases the held blocks once every piece has been sent or has failed
A follower makes its endpoint at OPEN_KV (the worker's advertised host, its role), when the worker
starts. The channel secret rides the pipe as bytes (rank 0 and its followers only) and is never
logged. A transfer that fails replies with its TransferFailure; a follower that is gone fails its
orders with RanksLost, which rank 0 reports as a TransferError (peer_lost): the decode side
recomputes, and the worker itself goes down (services/engine/ranks.py).

Wire of the orders' payloads (int64 arrays, strings as uint8 bytes):
    OPEN_KV     [endpoint, timeout_ms], host
    KV_CHANNEL  peer                                    -> channel
    RECV_KV     channel, [tag, num_blocks, first head, end head, landing]  -> [bytes, checksum, us]
    SEND_KV     channel, [tag, first head, end head], block_ids  -> [bytes, checksum, us]
    STREAM_KV   as SEND_KV, for blocks the STEP right after it computes (streamed layer by layer)
    DISCARD_KV  [landing]
    DROP_KV     channel
    CONNECT_KV  channel
where a channel is address, key, secret, backend. Tags count per channel (the channel's order); a
landing numbers a follower's received pieces across all its channels (COMMIT_KV and DISCARD_KV
name a piece by it).
    a failure   [TransferFailure index], message
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
import os
import threading
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from splitserve.services.disagg.handoff import PieceJob
from splitserve.services.disagg.plan import Piece, handoff_plan
from splitserve.services.disagg.transfer.base import (
    Backend,
    ChannelSpec,
    KVReceiver,
    KVSender,
    Moved,
    TransferError,
    TransferFailure,
)
from splitserve.services.disagg.transfer.isolated import make_receiver, make_sender
from splitserve.services.engine.cpu_threads import serial_torch_ops
from splitserve.services.engine.handoff_port import (
    HandoffPort,
    LandedPiece,
    held_reader,
    piece_buffer,
    release_piece_buffer,
)
from splitserve.services.engine.kv_cache.staging import Staging
from splitserve.services.engine.layer_progress import LayerProgress
from splitserve.services.engine.model_runner import bind_thread
from splitserve.services.engine.ranks import Message, Op, RanksLost, Status, bytes_array, encode

if TYPE_CHECKING:
    from splitserve.services.engine.model_runner import ModelRunner

log = logging.getLogger("splitserve.services.disagg")
_REASONS = list(TransferFailure)


class Endpoint(enum.IntEnum):
    """What OPEN_KV makes on a follower."""

    RECEIVER = 1  # a decode worker's rank: a receiver of its own (isolated.py make_receiver; its own TCPStore)
    SENDER = 2  # a prefill worker's rank: a sender of its own (make_sender)


@dataclass(frozen=True, slots=True)
class PieceReport:
    """One piece sent or received."""

    num_bytes: int
    checksum: int  # of the piece's bytes (services/disagg/transfer/checksum.py), as this side moved them
    seconds: float


# -- payloads ---------------------------------------------------------------------------------------
CHANNEL_ARRAYS = 4  # a channel's arrays at the head of an order


def channel_to_wire(channel: ChannelSpec) -> tuple[np.ndarray, ...]:
    texts = (channel.address.encode(), channel.key.encode(), channel.secret, channel.backend.value.encode())
    return tuple(bytes_array(text) for text in texts)


def channel_from_wire(address: np.ndarray, key: np.ndarray, secret: np.ndarray, backend: np.ndarray) -> ChannelSpec:
    names = (address.tobytes().decode(), key.tobytes().decode())
    return ChannelSpec(*names, secret.tobytes(), Backend(backend.tobytes().decode()))


def _report(tensor: torch.Tensor, moved: Moved) -> PieceReport:
    return PieceReport(tensor.numel() * tensor.element_size(), moved.checksum, moved.seconds)


def report_to_wire(report: PieceReport) -> tuple[np.ndarray]:
    # The checksum is 64 bits unsigned; the pipe carries int64: the same bits, read back as uint64.
    return (np.array([report.num_bytes, report.checksum, round(report.seconds * 1e6)], dtype=np.uint64).view(np.int64),)


def report_from_wire(arrays: Sequence[np.ndarray]) -> PieceReport:
    num_bytes, crc, micros = (int(x) for x in arrays[0].astype(np.int64).view(np.uint64))
    return PieceReport(num_bytes, crc, micros / 1e6)


def failure_to_wire(error: TransferError) -> tuple[np.ndarray, np.ndarray]:
    return np.array([_REASONS.index(error.reason)]), bytes_array(str(error).encode())


def _result(reply: Message) -> list[np.ndarray]:
    """A reply's payload, or its failure raised as the TransferError it was on the follower."""
    if reply.kind == Status.OK:
        return reply.arrays
    reason, message = reply.arrays
    raise TransferError(_REASONS[int(reason[0])], message.tobytes().decode())


async def _ask(port: HandoffPort, rank: int, op: Op, *arrays: np.ndarray) -> list[np.ndarray]:
    return await _reply(rank, port.ask_rank(rank, op, *arrays))


async def _reply(rank: int, reply: Awaitable[Message]) -> list[np.ndarray]:
    try:
        return _result(await reply)
    except RanksLost as e:
        raise TransferError(TransferFailure.PEER_LOST, f"rank {rank} of this worker is gone ({e})") from None


def start_loop_thread(name: str, device: torch.device) -> asyncio.AbstractEventLoop:
    """A new asyncio loop, run by a daemon thread of its own (stopped with loop.stop) bound to device,
    the worker's KV cache's (pinned staging, side streams and NCCL groups are made there: unbound, they
    would make a CUDA context on device 0 too). Its torch ops run serially: the cores belong to the
    step loop's forward (services/engine/cpu_threads.py), no second OpenMP pool beside it."""
    loop = asyncio.new_event_loop()

    def run() -> None:
        bind_thread(device)
        serial_torch_ops()
        asyncio.set_event_loop(loop)
        loop.run_forever()

    threading.Thread(target=run, name=name, daemon=True).start()
    return loop


# -- rank 0 ---------------------------------------------------------------------------------------------
async def open_rank_endpoints(port: HandoffPort, endpoint: Endpoint, host: str, timeout_s: float) -> None:
    """Give every follower rank of a tensor-parallel worker its own transport endpoint on the
    worker's host (once, at start; nothing to do for a single rank)."""
    size = port.tensor_parallel_size
    if size == 1:
        return
    numbers, address = np.array([int(endpoint), round(timeout_s * 1e3)]), bytes_array(host.encode())
    await asyncio.gather(*(_ask(port, rank, Op.OPEN_KV, numbers, address) for rank in range(1, size)))
    log.info("KV endpoints open on %d follower ranks (%s, in the engine core)", size - 1, endpoint.name.lower())


def connect_piece(port: HandoffPort, sender: KVSender, job: PieceJob) -> None:
    """Prefill side: the piece's rank starts joining its channel (while the prompt computes)."""
    if job.piece.src_rank == 0:
        sender.connect(job.channel)
        return
    try:
        port.tell_rank(job.piece.src_rank, Op.CONNECT_KV, *channel_to_wire(job.channel))
    except RanksLost:  # the send fails with peer_lost in its turn
        pass


def send_order(job: PieceJob, block_ids: Sequence[int]) -> tuple[np.ndarray, ...]:
    """SEND_KV's (and STREAM_KV's) payload: the piece's channel, tag and heads, the blocks."""
    heads = job.piece.heads
    return (*channel_to_wire(job.channel), np.array([job.tag, heads.start, heads.stop]), np.array(block_ids))


async def send_piece(
    port: HandoffPort,
    sender: KVSender,
    job: PieceJob,
    block_ids: Sequence[int],
    layers: LayerProgress | None = None,
    streaming: Future[Message] | None = None,
) -> PieceReport:
    """Prefill side: the piece's rank reads its heads of these held blocks and sends them. Streamed,
    as the step still computing them writes them: rank 0's with that step's progress (layers), a
    follower's by the STREAM_KV order given before that step (streaming: its reply)."""
    heads, rank = job.piece.heads, job.piece.src_rank
    if not block_ids:
        return PieceReport(0, 0, 0.0)
    if rank != 0:
        if streaming is not None:
            return report_from_wire(await _reply(rank, asyncio.wrap_future(streaming)))
        return report_from_wire(await _ask(port, rank, Op.SEND_KV, *send_order(job, block_ids)))
    staging = port.acquire_staging(len(block_ids), len(heads))
    fill = port.held_reader(block_ids, heads, staging.tensor, layers)  # gathered chunk by chunk as it is sent
    try:
        moved = await sender.send(job.channel, job.tag, staging.tensor, fill)
    except asyncio.CancelledError:  # the call is gone: nothing reads the buffer (a transfer under way ended first)
        port.release_staging(staging)
        raise
    port.release_staging(staging)  # after a failure gloo may still be reading it: never released
    return _report(staging.tensor, moved)


@dataclass(frozen=True, slots=True)
class Received:
    """Decode side: a piece landed on its rank, not yet in the cache."""

    piece: LandedPiece
    report: PieceReport
    staging: Staging | None  # rank 0's buffer (a follower keeps its own)


class RankReceivers:
    """Decode side, rank 0: the worker's receiving ranks. Rank 0 receives with the worker's
    KVReceiver; for each follower it keeps the channels the follower made (by peer, like
    channel_for; forgotten when dropped) and numbers the follower's transfers itself."""

    def __init__(self, receiver: KVReceiver, port: HandoffPort) -> None:
        self.receiver, self.port = receiver, port
        receiver.use_device(port.device)  # the channels it names get the wire for this worker's KV
        self._channels: dict[tuple[int, str], ChannelSpec] = {}  # (follower rank, peer) -> its channel
        self._tags: dict[str, itertools.count] = {}  # by follower channel key: rank 0 numbers their transfers
        self._landings = itertools.count(1)  # the followers' received pieces

    async def plan(self, peer: str, peer_size: int) -> tuple[PieceJob, ...]:
        """The pieces of a handoff from peer (a prefill worker of peer_size ranks), with channels and tags."""
        plan = handoff_plan(self.port.num_kv_heads, peer_size, self.port.tensor_parallel_size)
        return tuple(await asyncio.gather(*(self._piece_job(peer, piece) for piece in plan)))

    async def _piece_job(self, peer: str, piece: Piece) -> PieceJob:
        key = peer if piece.src_rank == 0 else f"{peer}#{piece.src_rank}"  # the sending process
        if piece.dst_rank == 0:
            channel = self.receiver.channel_for(key)
            return PieceJob(piece, channel, self.receiver.next_tag(channel))
        cached = self._channels.get((piece.dst_rank, key))
        if cached is None:
            wire = await _ask(self.port, piece.dst_rank, Op.KV_CHANNEL, bytes_array(key.encode()))
            cached = self._channels[(piece.dst_rank, key)] = channel_from_wire(*wire)
        return PieceJob(piece, cached, next(self._tags.setdefault(cached.key, itertools.count(1))))

    async def recv(self, job: PieceJob, num_blocks: int, pinned: Sequence[int] | None = None) -> Received:
        """A piece on its rank. Rank 0's goes chunk by chunk into pinned (the reservation's pinned
        blocks, HandoffPort.pin) as it lands, when given; else it stays in its buffer until land()."""
        heads, rank = job.piece.heads, job.piece.dst_rank
        if rank != 0:
            landing = next(self._landings)
            numbers = np.array([job.tag, num_blocks, heads.start, heads.stop, landing])
            report = report_from_wire(await _ask(self.port, rank, Op.RECV_KV, *channel_to_wire(job.channel), numbers))
            return Received(LandedPiece(rank, heads, None, landing), report, None)
        staging = self.port.acquire_staging(num_blocks, len(heads))
        buffer = staging.tensor
        drain = None if pinned is None else self.port.row_writer(pinned, heads, buffer)
        moved = await self.receiver.recv(job.channel, job.tag, buffer, drain)  # a failed one is never released
        return Received(LandedPiece(0, heads, None if drain else buffer, job.tag), _report(buffer, moved), staging)

    def release(self, received: Received, committed: bool) -> None:
        """After land(): rank 0's buffer back to the pool; a follower's piece, unless committed, dropped."""
        if received.staging is not None:
            self.port.release_staging(received.staging)
        elif not committed:
            self._tell(received.piece.rank, Op.DISCARD_KV, np.array([received.piece.tag]))

    def drop(self, job: PieceJob) -> None:
        """Forget the piece's channel (failed): the next plan names a new one."""
        rank = job.piece.dst_rank
        if rank == 0:
            self.receiver.drop(job.channel)
            return
        for key, channel in list(self._channels.items()):
            if channel == job.channel:
                del self._channels[key]
                self._tell(rank, Op.DROP_KV, *channel_to_wire(channel))

    def _tell(self, rank: int, op: Op, *arrays: np.ndarray) -> None:
        try:
            self.port.tell_rank(rank, op, *arrays)
        except RanksLost:  # nothing left to release there; the worker is going down
            pass


# -- a follower ---------------------------------------------------------------------------------------
class RankAgent:
    """A follower rank's KV transfers, run by an asyncio loop on a thread of its own (so a transfer
    never blocks the step loop). It owns its endpoint and the pieces it received and that are not
    yet committed or discarded (_landed, by landing: the step loop takes one at COMMIT_KV, hence the
    lock). It is the only writer of replies on the follower's pipe."""

    def __init__(self, runner: ModelRunner, reply: Callable[[bytes], None]) -> None:
        self._runner, self._reply = runner, reply
        self._receiver: KVReceiver | None = None
        self._sender: KVSender | None = None
        self._lock = threading.Lock()
        self._landed: dict[int, Staging] = {}
        self._tasks: set[asyncio.Task] = set()
        self._loop = start_loop_thread("kv-rank-transfers", runner.device)  # it reads and writes this rank's cache

    def submit(self, order: Message, layers: LayerProgress | None = None) -> None:
        self._loop.call_soon_threadsafe(self._start, order, layers)

    def _start(self, order: Message, layers: LayerProgress | None) -> None:
        task = self._loop.create_task(self._carry_out(order, layers))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _carry_out(self, order: Message, layers: LayerProgress | None) -> None:
        op = Op(order.kind)
        try:
            if op is Op.STREAM_KV:
                payload = await self._send(*order.arrays, layers=layers)
            else:
                payload = await self._HANDLERS[op](self, *order.arrays)
            status = Status.OK
        except TransferError as e:
            payload, status = failure_to_wire(e), Status.FAILED
        except Exception:  # a bug: this rank is out of step with rank 0 for good; take the worker down
            log.exception("the KV transfer agent failed on %s", op.name)
            os._exit(70)
        if order.number:
            self._reply(encode(status, *payload, number=order.number))

    def commit(self, landing: int, write: Callable[[torch.Tensor], None]) -> None:
        """On the step loop: write(piece) for a landed piece, then its buffer goes back to the pool."""
        with self._lock:
            staging = self._landed.pop(landing)
        write(staging.tensor)
        self._loop.call_soon_threadsafe(release_piece_buffer, self._runner, staging)

    # -- orders (on the agent's loop) ---------------------------------------------------------------
    async def _open(self, numbers: np.ndarray, host: np.ndarray) -> tuple[np.ndarray, ...]:
        endpoint, timeout_ms = (int(x) for x in numbers)
        name = host.tobytes().decode()
        try:
            if endpoint == Endpoint.RECEIVER:
                self._receiver = make_receiver(name, timeout_ms / 1e3, self._runner.device)
            else:
                self._sender = make_sender(name, timeout_ms / 1e3, self._runner.device)
        except (OSError, RuntimeError) as e:  # the host is not this machine's, or its store failed
            raise TransferError(TransferFailure.CONNECT, f"no KV endpoint on {name}: {e}") from None
        return ()

    async def _channel(self, peer: np.ndarray) -> tuple[np.ndarray, ...]:
        return channel_to_wire(self._receiving().channel_for(peer.tobytes().decode()))

    async def _recv(self, *arrays: np.ndarray) -> tuple[np.ndarray, ...]:
        tag, num_blocks, first, stop, landing = (int(x) for x in arrays[CHANNEL_ARRAYS])
        staging = piece_buffer(self._runner, num_blocks, stop - first)
        moved = await self._receiving().recv(channel_from_wire(*arrays[:CHANNEL_ARRAYS]), tag, staging.tensor)
        with self._lock:
            self._landed[landing] = staging
        return report_to_wire(_report(staging.tensor, moved))

    async def _send(self, *arrays: np.ndarray, layers: LayerProgress | None = None) -> tuple[np.ndarray, ...]:
        (tag, first, stop), block_ids = (int(x) for x in arrays[CHANNEL_ARRAYS]), arrays[CHANNEL_ARRAYS + 1].tolist()
        channel, sender = channel_from_wire(*arrays[:CHANNEL_ARRAYS]), self._sending()
        staging = piece_buffer(self._runner, len(block_ids), stop - first)
        fill = held_reader(self._runner, block_ids, range(first, stop), staging.tensor, layers)
        moved = await sender.send(channel, tag, staging.tensor, fill)
        release_piece_buffer(self._runner, staging)  # a failed send's buffer is never released (gloo may still read it)
        return report_to_wire(_report(staging.tensor, moved))

    async def _discard(self, landing: np.ndarray) -> tuple[np.ndarray, ...]:
        with self._lock:
            staging = self._landed.pop(int(landing[0]), None)
        if staging is not None:
            release_piece_buffer(self._runner, staging)
        return ()

    async def _drop(self, *channel: np.ndarray) -> tuple[np.ndarray, ...]:
        self._receiving().drop(channel_from_wire(*channel))
        return ()

    async def _connect(self, *channel: np.ndarray) -> tuple[np.ndarray, ...]:
        self._sending().connect(channel_from_wire(*channel))
        return ()

    _HANDLERS: dict[Op, Callable[..., Awaitable[tuple[np.ndarray, ...]]]] = {
        Op.OPEN_KV: _open,
        Op.KV_CHANNEL: _channel,
        Op.RECV_KV: _recv,
        Op.SEND_KV: _send,
        Op.DISCARD_KV: _discard,
        Op.DROP_KV: _drop,
        Op.CONNECT_KV: _connect,
    }

    def _receiving(self) -> KVReceiver:
        if self._receiver is None:
            raise TransferError(TransferFailure.CLOSED, "this rank has no KV receiver (OPEN_KV was not given)")
        return self._receiver

    def _sending(self) -> KVSender:
        if self._sender is None:
            raise TransferError(TransferFailure.CLOSED, "this rank has no KV sender (OPEN_KV was not given)")
        return self._sender

    def close(self) -> None:
        for endpoint in (self._receiver, self._sender):
            if endpoint is not None:
                endpoint.close()
        self._loop.call_soon_threadsafe(self._loop.stop)
