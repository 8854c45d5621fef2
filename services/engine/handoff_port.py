"""The engine's side of a KV handoff between tiers: the one door through which services/disagg/ and services/worker/
reach the engine's insides (tests/unit/test_layout.py checks that they use nothing else of it).

Split by role, as vLLM's KV connector is (scheduler side / worker side):

Decode side:
    reserve(request)            blocks for the whole prompt before any KV moves -> Reservation, or
                                None while the pool cannot hold it; the reservation owns its
                                blocks until it is landed, recomputed or the request ends
    accept_first_token(...)     the prefill worker's first token
    land(reservation, pieces)   write the received KV heads into each rank's cache (rank 0's
                                here, a follower's by COMMIT_KV, ordered before the next step),
                                admit the request to the batch
    recompute(reservation)      drop the reservation, compute the prompt here instead

Prefill side:
    claim_held / held_reader / release_held(_soon)   the held blocks, under their lease (services/engine/leases.py)
    stream_as_computed(request, start, follower_orders)  or the blocks claimed when the step computing the prompt's
                                last chunk is scheduled, read layer by layer as it computes them

Both: staging buffers for the pieces in flight, the follower ranks' orders (ask_rank / tell_rank:
their KV transfers, services/disagg/rank_transfers.py). Every mutation runs on the engine core's step loop
between steps (StepLoop.call). What a worker reads of its engine (its load, sizes, KV events) comes from the
engine core's client (services/engine/core_client.py).
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from splitserve.services.engine.engine import Engine
from splitserve.services.engine.kv_cache.block_io import gather_blocks
from splitserve.services.engine.kv_cache.block_pool import BlockId
from splitserve.services.engine.kv_cache.staging import Staging
from splitserve.services.engine.layer_progress import LayerProgress
from splitserve.services.engine.ranks import Followers, Message, Op, RanksLost, commit_to_wire
from splitserve.services.engine.request import Request
from splitserve.services.engine.sampler import TokenLogprobs
from splitserve.services.engine.step_loop import StepLoop
from splitserve.services.engine.step_stats import StepKind, StepTotals
from splitserve.services.engine.streams import post_to_loop, set_result

if TYPE_CHECKING:
    from splitserve.services.engine.model_runner import ModelRunner


@dataclass(eq=False, slots=True)
class Reservation:
    """Decode side: the prompt's blocks, reserved for an incoming transfer."""

    request: Request
    num_held_blocks: int  # leading prompt blocks already here (prefix hits): not transferred
    num_blocks_to_land: int  # the prompt's other blocks: what the transfer must carry


@dataclass(frozen=True, slots=True)
class LandedPiece:
    """Decode side: KV heads one rank received for a reservation, not yet in its cache."""

    rank: int
    heads: range  # global KV heads
    # rank 0's, [layers, 2, n, block_size, len(heads), head_dim]; None: a follower's, or rank 0's
    # already written into the pinned blocks as it arrived
    blocks: torch.Tensor | None
    tag: int  # a follower's name for its piece (it keeps the tensor): COMMIT_KV / DISCARD_KV


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """What the worker reports (GetLoad, metrics, the drain log)."""

    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    block_size: int
    num_awaiting_kv: int  # reservations KV may still land in (parked ones too: Scheduler.pin_reserved)
    num_held_blocks: int
    num_held_requests: int
    kv_usage: float
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_lease_expiries: int
    num_failed_requests: int
    tensor_parallel_size: int
    steps: dict[StepKind, StepTotals]  # what the engine's steps cost so far, by kind


def engine_load(engine: Engine) -> EngineLoad:
    """The engine's load, read between steps or racily (as a metrics scrape reads it)."""
    e, s = engine, engine.scheduler
    return EngineLoad(
        num_running=s.num_running,
        num_waiting=s.num_waiting,
        num_free_blocks=e.kv.num_free_blocks,
        num_total_blocks=e.runner.num_blocks,
        block_size=e.runtime.block_size,
        num_awaiting_kv=len(s.awaiting_kv) + e.kv.num_parked,
        num_held_blocks=e.num_held_blocks(),
        num_held_requests=len(s.held),
        kv_usage=e.kv_usage(),
        num_preemptions=s.stats.num_preemptions,
        prefix_cache_queries=s.stats.prefix_cache_queries,
        prefix_cache_hits=s.stats.prefix_cache_hits,
        num_lease_expiries=e.leases.num_expired,
        num_failed_requests=e.stats.num_failed_requests,
        tensor_parallel_size=e.runner.tp.size,
        steps=e.step_stats.snapshot(),
    )


def piece_buffer(runner: ModelRunner, num_blocks: int, num_heads: int) -> Staging:
    """A buffer for a piece in flight ([layers, 2, num_blocks, block_size, num_heads, head_dim]): a
    reused host buffer for a host cache; for a CUDA cache one on the device (the caching allocator
    reuses its memory), which the transport moves device to device or through pinned memory."""
    cache = runner.kv_cache
    if cache.device.type != "cuda":
        return runner.acquire_piece(num_blocks, num_heads)
    shape = (*cache.shape[:2], num_blocks, cache.shape[3], num_heads, cache.shape[5])
    tensor = torch.empty(shape, dtype=cache.dtype, device=cache.device)
    return Staging(tensor, tensor, num_blocks)


def release_piece_buffer(runner: ModelRunner, staging: Staging) -> None:
    """After a piece_buffer is used: a host buffer goes back to the pool."""
    if staging.storage.device.type == "cpu":
        runner.staging.release(staging)


def held_reader(
    runner: ModelRunner,
    block_ids: Sequence[int],
    heads: range,
    out: torch.Tensor,
    layers: LayerProgress | None = None,
) -> Callable[[slice], None]:
    """fill(rows) that copies rows [start, stop) of out's [num_layers * 2, -1] view from these heads of
    these blocks, as the transport sends them (services/disagg/transfer/chunks.py). Every head, into a buffer
    on the cache's device, is gathered a chunk at a time (overlapping the wire); anything else (some
    heads) is read whole at the first call. layers: the progress of the step still computing these
    blocks (streaming): each read first waits for the layers it reads (all of them, read whole)."""
    if runner.local_heads(heads) == slice(0, runner.num_local_kv_heads) and out.device == runner.kv_cache.device:

        def gather(rows: slice) -> None:
            if layers is not None:
                layers.wait_rows(rows)
            gather_blocks(runner.kv_cache, block_ids, out, rows)

        return gather
    read: list[bool] = []

    def read_whole(rows: slice) -> None:
        if not read:
            if layers is not None:
                layers.wait(layers.num_layers)
            runner.read_heads(block_ids, heads, out)
            read.append(True)

    return read_whole


class HandoffPort:
    def __init__(self, steps: StepLoop) -> None:
        """steps: the step loop of a prefill or decode worker's engine core, which drives its engine."""
        self._steps = steps
        self._engine = steps.engine

    @property
    def kv_layout(self) -> str:
        """Blocks move only between workers whose layouts are equal (model, dtype, block size)."""
        return self._engine.runner.kv_layout

    # -- decode side ----------------------------------------------------------------------------
    async def reserve(self, request: Request) -> Reservation:
        """The prompt's blocks, reserved now or once the pool has room for them (queued in the
        engine in arrival order: Engine.queue_reservation). Leaving early does not withdraw it: the
        request's abort does."""
        loop = asyncio.get_running_loop()
        reserved: asyncio.Future[int] = loop.create_future()
        await self._steps.call(
            self._engine.queue_reservation, request, lambda num_held: post_to_loop(loop, set_result, reserved, num_held)
        )
        num_held = await reserved
        return Reservation(request, num_held, request.num_prompt_blocks - num_held)

    async def accept_first_token(
        self,
        reservation: Reservation,
        token_id: int,
        logprobs: TokenLogprobs | None,
        prefill_ms: tuple[float, float],
    ) -> None:
        """The token goes out like a step's (nothing happens if the request is gone)."""
        await self._steps.call(
            self._engine.accept_first_token,
            reservation.request.request_id,
            token_id,
            logprobs,
            prefill_ms,
        )

    async def land(self, reservation: Reservation, pieces: Sequence[LandedPiece]) -> bool:
        """Write every rank's pieces into the prompt's blocks after the held ones and admit the
        request. False, writing nothing, if the request is gone (the caller discards the pieces)."""
        return await self._steps.call(
            self._engine.admit_transferred,
            reservation.request.request_id,
            reservation.num_held_blocks,
            lambda block_ids: self._write_pieces(block_ids, pieces),
        )

    def _write_pieces(self, block_ids: Sequence[int], pieces: Sequence[LandedPiece]) -> None:
        """On the engine loop, between steps: a follower's COMMIT_KV reaches it before the next STEP.
        Rank 0's piece is already in the cache when it was written as it arrived (blocks None)."""
        runner = self._engine.runner
        for piece in pieces:
            if piece.rank != 0:
                self._followers.tell(piece.rank, Op.COMMIT_KV, *commit_to_wire(piece.tag, block_ids, piece.heads))
            elif piece.blocks is not None:
                if piece.blocks.shape[2] != len(block_ids):
                    raise ValueError(f"a piece carried {piece.blocks.shape[2]} blocks for {len(block_ids)} reserved")
                runner.write_heads(block_ids, piece.heads, piece.blocks)

    def pin(self, reservation: Reservation) -> list[BlockId] | None:
        """Directly (thread-safe): the blocks the transfer lands in, pinned so that whatever ends the
        reservation meanwhile parks them instead of freeing them (Engine.pin_reserved); None if it
        is gone. Once every receive into them has ended, unpin_soon."""
        return self._engine.pin_reserved(reservation.request.request_id, reservation.num_held_blocks)

    def unpin_soon(self, reservation: Reservation) -> None:
        """Between steps, without waiting: parked blocks go back to the pool (they count as KV in
        flight, load().num_awaiting_kv, until then)."""
        self._steps.post(self._engine.unpin, reservation.request.request_id)

    def row_writer(self, block_ids: Sequence[int], heads: range, piece: torch.Tensor) -> Callable[[slice], None]:
        """drain(rows) for a receive (services/disagg/transfer/base.py): rows [start, stop) of piece's
        [num_layers * 2, -1] view into these KV heads of these pinned blocks, beside a step."""
        return self._engine.runner.row_writer(block_ids, heads, piece)

    async def recompute(self, reservation: Reservation) -> bool:
        """The transfer failed: free the reservation and prefill here. False if the request is gone."""
        return await self._steps.call(self._engine.recompute_locally, reservation.request.request_id)

    # -- prefill side ---------------------------------------------------------------------------
    def stream_as_computed(
        self,
        request: Request,
        start: Callable[[Sequence[int], LayerProgress, list[Future[Message]]], None],
        follower_orders: Callable[[Sequence[int]], list[tuple[int, tuple[np.ndarray, ...]]]] | None = None,
    ) -> None:
        """Before request is added: once the step that computes the last chunk of its prompt is
        scheduled, start(block_ids, layers, streaming) runs on this event loop, with the prompt's
        blocks (already claimed for the sender: no lease; release_held after the send frees them,
        even if that step fails) and the step's progress, which held_reader waits on layer by layer.
        follower_orders(block_ids): (rank, payload) of the STREAM_KV orders for follower ranks, given
        before that step reaches them; streaming holds their replies, in that order."""
        loop, context = asyncio.get_running_loop(), contextvars.copy_context()  # the caller's (its trace)

        def from_step(block_ids: Sequence[BlockId], layers: LayerProgress) -> None:  # on the step thread
            orders = follower_orders(block_ids) if follower_orders is not None else []
            streaming = [self._ask_now(rank, Op.STREAM_KV, *payload) for rank, payload in orders]
            try:
                loop.call_soon_threadsafe(start, block_ids, layers, streaming, context=context)
            except RuntimeError:  # the event loop is closed: the worker is going down
                pass

        request.kv_stream = from_step

    async def claim_held(self, request_id: str) -> bool:
        """Directly, not between steps: the lease is thread-safe, and the step thread may be in the next
        prompt's forward (waiting for it delayed every handoff by up to a prefill step)."""
        return self._engine.claim_held(request_id)

    def held_reader(
        self, block_ids: Sequence[int], heads: range, out: torch.Tensor, layers: LayerProgress | None = None
    ) -> Callable[[slice], None]:
        """fill(rows) for a send of rank 0's slice of held blocks (these global KV heads) into out
        (held_reader above; claimed blocks are written by nobody but the step computing them, whose
        layers it then waits for: safe beside a step)."""
        return held_reader(self._engine.runner, block_ids, heads, out, layers)

    async def release_held(self, request_id: str) -> bool:
        return await self._steps.call(self._engine.release_held, request_id)

    def release_held_soon(self, request_id: str) -> None:
        """Release between steps without waiting: the step thread may be a whole prefill forward away,
        and the sent KV need not wait for its blocks to be freed."""
        self._steps.post(self._engine.release_held, request_id)

    # -- both -----------------------------------------------------------------------------------
    @property
    def tensor_parallel_size(self) -> int:
        return self._engine.runner.tp.size

    @property
    def num_kv_heads(self) -> int:
        return self._engine.runner.arch.num_kv_heads

    @property
    def device(self) -> torch.device:
        """Where this worker's KV cache (rank 0's) lives: the transport picks its wire for it."""
        return self._engine.runner.device

    def acquire_staging(self, num_blocks: int, num_heads: int) -> Staging:
        """A buffer for num_heads KV heads of num_blocks blocks (piece_buffer; release_staging it once used)."""
        return piece_buffer(self._engine.runner, num_blocks, num_heads)

    def release_staging(self, staging: Staging) -> None:
        release_piece_buffer(self._engine.runner, staging)

    async def ask_rank(self, rank: int, op: Op, *arrays: np.ndarray) -> Message:
        """An order to follower rank (>= 1) and its reply; RanksLost if that rank is gone."""
        return await asyncio.wrap_future(self._followers.ask(rank, op, *arrays))

    def _ask_now(self, rank: int, op: Op, *arrays: np.ndarray) -> Future[Message]:
        """ask_rank from any thread, in order with whatever else that thread tells the ranks next."""
        try:
            return self._followers.ask(rank, op, *arrays)
        except RanksLost as e:
            lost: Future[Message] = Future()
            lost.set_exception(e)
            return lost

    def tell_rank(self, rank: int, op: Op, *arrays: np.ndarray) -> None:
        """An order to follower rank that wants no reply (not one that must fall between steps)."""
        self._followers.tell(rank, op, *arrays)

    @property
    def _followers(self) -> Followers:
        followers = self._engine.runner.followers
        if followers is None:
            raise RuntimeError("this worker has a single rank: no follower takes orders")
        return followers
