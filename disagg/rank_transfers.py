"""KV handoffs rank to rank: each rank of a tensor-parallel worker sends or receives the KV heads it
holds (a piece, disagg/plan.py) on a transport endpoint of its own; nothing is gathered through
rank 0. Rank 0 moves its own pieces with the worker's KVReceiver / KVSender and gives its followers
orders over their pipes (engine/ranks.py; rank 0 reaches them through HandoffPort).

Lifecycle of a piece on a follower (RankAgent, its transfer thread):
    decode:  KV_CHANNEL (its channel to a prefill rank, cached by rank 0) -> RECV_KV (into a staging
             buffer; reply: bytes, CRC) -> landed -> COMMIT_KV (on the step loop, between steps:
             written into the cache) or DISCARD_KV (the handoff failed or the request is gone)
    prefill: CONNECT_KV (join the channel while the prompt computes) -> SEND_KV (read its heads of
             the held blocks, send; reply: bytes, CRC); rank 0 releases the held blocks once every
             piece has been sent or has failed
A follower makes its endpoint at OPEN_KV (the worker's advertised host, its role), when the worker
starts. The channel secret rides the pipe as bytes (rank 0 and its followers only) and is never
logged. A transfer that fails replies with its TransferFailure; a follower that is gone fails its
orders with RanksLost, which rank 0 reports as a TransferError (peer_lost): the decode side
recomputes, and the worker itself goes down (engine/ranks.py).

Wire of the orders' payloads (int64 arrays, strings as uint8 bytes):
    OPEN_KV     [endpoint, timeout_ms], host
    KV_CHANNEL  peer                                    -> address, key, secret
    RECV_KV     address, key, secret, [tag, num_blocks, first head, end head]  -> [bytes, crc, us]
    SEND_KV     address, key, secret, [tag, first head, end head], block_ids  -> [bytes, crc, us]
    DISCARD_KV  [tag]
    DROP_KV     address, key, secret
    CONNECT_KV  address, key, secret
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
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from splitserve.disagg.handoff import PieceJob
from splitserve.disagg.plan import Piece, handoff_plan
from splitserve.disagg.transfer.base import ChannelSpec, KVReceiver, KVSender, TransferError, TransferFailure
from splitserve.disagg.transfer.torch_dist import TorchDistReceiver, TorchDistSender
from splitserve.engine.handoff_port import HandoffPort, LandedPiece
from splitserve.engine.kv_cache.block_io import checksum
from splitserve.engine.kv_cache.staging import Staging
from splitserve.engine.ranks import Message, Op, RanksLost, Status, bytes_array, encode

if TYPE_CHECKING:
    from splitserve.engine.model_runner import ModelRunner

log = logging.getLogger("splitserve.disagg")
_REASONS = list(TransferFailure)


class Endpoint(enum.IntEnum):
    """What OPEN_KV makes on a follower."""

    RECEIVER = 1  # a decode worker's rank: a TorchDistReceiver (hosts its own TCPStore)
    SENDER = 2  # a prefill worker's rank: a TorchDistSender


@dataclass(frozen=True, slots=True)
class PieceReport:
    """One piece sent or received."""

    num_bytes: int
    checksum: int  # CRC-32 of the piece's bytes
    seconds: float


# -- payloads ---------------------------------------------------------------------------------------
def channel_to_wire(channel: ChannelSpec) -> tuple[np.ndarray, ...]:
    return bytes_array(channel.address.encode()), bytes_array(channel.key.encode()), bytes_array(channel.secret)


def channel_from_wire(address: np.ndarray, key: np.ndarray, secret: np.ndarray) -> ChannelSpec:
    return ChannelSpec(address.tobytes().decode(), key.tobytes().decode(), secret.tobytes())


def report_to_wire(report: PieceReport) -> tuple[np.ndarray]:
    return (np.array([report.num_bytes, report.checksum, round(report.seconds * 1e6)]),)


def report_from_wire(arrays: Sequence[np.ndarray]) -> PieceReport:
    num_bytes, crc, micros = (int(x) for x in arrays[0])
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
    try:
        reply = await port.ask_rank(rank, op, *arrays)
    except RanksLost as e:
        raise TransferError(TransferFailure.PEER_LOST, f"rank {rank} of this worker is gone ({e})") from None
    return _result(reply)


# -- rank 0 ---------------------------------------------------------------------------------------------
async def open_rank_endpoints(port: HandoffPort, endpoint: Endpoint, host: str, timeout_s: float) -> None:
    """Give every follower rank its own transport endpoint on the worker's host (once, at start)."""
    numbers, address = np.array([int(endpoint), round(timeout_s * 1e3)]), bytes_array(host.encode())
    size = port.tensor_parallel_size
    await asyncio.gather(*(_ask(port, rank, Op.OPEN_KV, numbers, address) for rank in range(1, size)))


def connect_piece(port: HandoffPort, sender: KVSender, job: PieceJob) -> None:
    """Prefill side: the piece's rank starts joining its channel (while the prompt computes)."""
    if job.piece.src_rank == 0:
        sender.connect(job.channel)
        return
    try:
        port.tell_rank(job.piece.src_rank, Op.CONNECT_KV, *channel_to_wire(job.channel))
    except RanksLost:  # the send fails with peer_lost in its turn
        pass


async def send_piece(port: HandoffPort, sender: KVSender, job: PieceJob, block_ids: Sequence[int]) -> PieceReport:
    """Prefill side: the piece's rank reads its heads of these held blocks and sends them."""
    heads, rank = job.piece.heads, job.piece.src_rank
    if not block_ids:
        return PieceReport(0, 0, 0.0)
    if rank != 0:
        wire = (*channel_to_wire(job.channel), np.array([job.tag, heads.start, heads.stop]), np.array(block_ids))
        return report_from_wire(await _ask(port, rank, Op.SEND_KV, *wire))
    staging = port.acquire_staging(len(block_ids), len(heads))
    blocks = await port.read_held(block_ids, heads, staging.tensor)
    sending = asyncio.ensure_future(sender.send(job.channel, job.tag, blocks))
    crc = await asyncio.to_thread(checksum, blocks)  # overlaps the send (both only read blocks)
    seconds = await sending  # after a failure gloo may still be reading the buffer: never released
    port.release_staging(staging)
    return PieceReport(blocks.numel() * blocks.element_size(), crc, seconds)


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
        self._channels: dict[tuple[int, str], ChannelSpec] = {}  # (follower rank, peer) -> its channel
        self._tags = itertools.count(1)  # for the followers' channels (rank 0 gives all their tags)

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
        return PieceJob(piece, cached, next(self._tags))

    async def recv(self, job: PieceJob, num_blocks: int) -> Received:
        heads, rank = job.piece.heads, job.piece.dst_rank
        if rank != 0:
            numbers = np.array([job.tag, num_blocks, heads.start, heads.stop])
            report = report_from_wire(await _ask(self.port, rank, Op.RECV_KV, *channel_to_wire(job.channel), numbers))
            return Received(LandedPiece(rank, heads, None, job.tag), report, None)
        staging = self.port.acquire_staging(num_blocks, len(heads))
        seconds = await self.receiver.recv(job.channel, job.tag, staging.tensor)  # a failed one is never released
        crc = await asyncio.to_thread(checksum, staging.tensor)
        report = PieceReport(staging.tensor.numel() * staging.tensor.element_size(), crc, seconds)
        return Received(LandedPiece(0, heads, staging.tensor, job.tag), report, staging)

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
    yet committed or discarded (_landed, by tag: the step loop takes one at COMMIT_KV, hence the
    lock). It is the only writer of replies on the follower's pipe."""

    def __init__(self, runner: ModelRunner, reply: Callable[[bytes], None]) -> None:
        self._runner, self._reply = runner, reply
        self._receiver: TorchDistReceiver | None = None
        self._sender: TorchDistSender | None = None
        self._lock = threading.Lock()
        self._landed: dict[int, Staging] = {}
        self._tasks: set[asyncio.Task] = set()
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._run, name="kv-rank-transfers", daemon=True).start()

    def _run(self) -> None:
        from splitserve.engine.model_runner import bind_thread

        bind_thread(self._runner.device)  # it reads and writes this rank's cache
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    def submit(self, order: Message) -> None:
        self._loop.call_soon_threadsafe(self._start, order)

    def _start(self, order: Message) -> None:
        task = self._loop.create_task(self._carry_out(order))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _carry_out(self, order: Message) -> None:
        op = Op(order.kind)
        try:
            payload, status = await self._HANDLERS[op](self, *order.arrays), Status.OK
        except TransferError as e:
            payload, status = failure_to_wire(e), Status.FAILED
        except Exception:  # a bug: this rank is out of step with rank 0 for good; take the worker down
            log.exception("the KV transfer agent failed on %s", op.name)
            os._exit(70)
        if order.number:
            self._reply(encode(status, *payload, number=order.number))

    def commit(self, tag: int, write: Callable[[torch.Tensor], None]) -> None:
        """On the step loop: write(piece) for a landed piece, then its buffer goes back to the pool."""
        with self._lock:
            staging = self._landed.pop(tag)
        write(staging.tensor)
        self._loop.call_soon_threadsafe(self._runner.staging.release, staging)

    # -- orders (on the agent's loop) ---------------------------------------------------------------
    async def _open(self, numbers: np.ndarray, host: np.ndarray) -> tuple[np.ndarray, ...]:
        endpoint, timeout_ms = (int(x) for x in numbers)
        name = host.tobytes().decode()
        try:
            if endpoint == Endpoint.RECEIVER:
                self._receiver = TorchDistReceiver(name, timeout_ms / 1e3)
            else:
                self._sender = TorchDistSender(name, timeout_ms / 1e3)
        except (OSError, RuntimeError) as e:  # the host is not this machine's, or its store failed
            raise TransferError(TransferFailure.CONNECT, f"no KV endpoint on {name}: {e}") from None
        return ()

    async def _channel(self, peer: np.ndarray) -> tuple[np.ndarray, ...]:
        return channel_to_wire(self._receiving().channel_for(peer.tobytes().decode()))

    async def _recv(self, *arrays: np.ndarray) -> tuple[np.ndarray, ...]:
        tag, num_blocks, first, stop = (int(x) for x in arrays[3])
        staging = self._runner.acquire_piece(num_blocks, stop - first)
        seconds = await self._receiving().recv(channel_from_wire(*arrays[:3]), tag, staging.tensor)
        crc = await asyncio.to_thread(checksum, staging.tensor)
        with self._lock:
            self._landed[tag] = staging
        return report_to_wire(PieceReport(staging.tensor.numel() * staging.tensor.element_size(), crc, seconds))

    async def _send(self, *arrays: np.ndarray) -> tuple[np.ndarray, ...]:
        (tag, first, stop), block_ids = (int(x) for x in arrays[3]), arrays[4].tolist()
        channel, sender = channel_from_wire(*arrays[:3]), self._sending()
        sender.connect(channel)  # joins while the heads are read
        staging = self._runner.acquire_piece(len(block_ids), stop - first)
        blocks = await asyncio.to_thread(self._runner.read_heads, block_ids, range(first, stop), staging.tensor)
        sending = asyncio.ensure_future(sender.send(channel, tag, blocks))
        crc = await asyncio.to_thread(checksum, blocks)
        seconds = await sending  # a failed send's buffer is never released (gloo may still read it)
        self._runner.staging.release(staging)
        return report_to_wire(PieceReport(blocks.numel() * blocks.element_size(), crc, seconds))

    async def _discard(self, tag: np.ndarray) -> tuple[np.ndarray, ...]:
        with self._lock:
            staging = self._landed.pop(int(tag[0]), None)
        if staging is not None:
            self._runner.staging.release(staging)
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

    def _receiving(self) -> TorchDistReceiver:
        if self._receiver is None:
            raise TransferError(TransferFailure.CLOSED, "this rank has no KV receiver (OPEN_KV was not given)")
        return self._receiver

    def _sending(self) -> TorchDistSender:
        if self._sender is None:
            raise TransferError(TransferFailure.CLOSED, "this rank has no KV sender (OPEN_KV was not given)")
        return self._sender

    def close(self) -> None:
        for endpoint in (self._receiver, self._sender):
            if endpoint is not None:
                endpoint.close()
        self._loop.call_soon_threadsafe(self._loop.stop)
