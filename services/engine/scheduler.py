"""Continuous (iteration-level) batching over the paged KV cache.

Request lifecycle: waiting -> running -> finished, with running -> waiting on preemption
(recompute: the request's blocks are freed and its KV recomputed later, cheaply when its blocks
are still in the prefix cache). The decode tier adds awaiting_kv -> waiting in front (blocks
reserved while the KV is in flight), and awaiting_room before it (a reservation the pool cannot
hold yet, retried in arrival order as blocks free); the prefill tier adds finished -> held (blocks
kept until they are sent).

Each step: running requests first (decodes and unfinished chunked prefills), preempting the
running request last in service order (see `service_key`) when blocks run out; then, if nothing
was preempted, waiting requests join while the token budget, max_num_seqs and free blocks allow:
requests whose KV landed from a prefill worker first, then the rest, each in service order. Once one
cannot join, later ones wait behind it, except landed ones: they already hold their prompt's
blocks, which only running them gives back (see `_schedule_waiting`).
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from splitserve.services.engine.config import RuntimeInfo, SchedulerConfig
from splitserve.services.engine.kv_cache.manager import KVCacheManager, PrefixHit
from splitserve.services.engine.request import Request, RequestStatus
from splitserve.services.engine.scheduler_output import (  # noqa: F401  (re-exported)
    ScheduledRequest,
    SchedulerOutput,
    StepUpdate,
)

_RUNNING = RequestStatus.RUNNING


@dataclass(slots=True)
class SchedulerStats:
    """Cumulative counters for metrics."""

    num_preemptions: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens found


def service_key(r: Request, use_priority: bool) -> tuple:
    """Service order: min() is served first, max() is the preemption victim.

    "priority": lowest priority value first, then arrival. "fcfs": arrival alone (the client's
    priority is ignored, for preemption too).
    """
    return (r.priority, r.arrival_seq) if use_priority else (r.arrival_seq,)


class WaitingQueue:
    """Waiting requests: landed ones (holding their prompt's blocks) first, each in service order.

    Landed requests go first whatever their priority: their blocks are taken already, they need at
    most one more, and the blocks come back only once they run. A request's landed flag cannot
    change while it waits: it leaves the queue to gain or lose blocks.
    """

    def __init__(self, use_priority: bool) -> None:
        self._use_priority = use_priority
        self._keys: list[tuple] = []
        self._requests: list[Request] = []

    def add(self, request: Request, landed: bool = False) -> None:
        key = (not landed, *service_key(request, self._use_priority))
        i = bisect.bisect(self._keys, key)
        self._keys.insert(i, key)
        self._requests.insert(i, request)

    def remove(self, request: Request) -> None:
        i = self._requests.index(request)
        del self._keys[i], self._requests[i]

    def __len__(self) -> int:
        return len(self._requests)

    def __iter__(self):
        return iter(self._requests)


class Scheduler:
    def __init__(self, config: SchedulerConfig, runtime: RuntimeInfo, kv: KVCacheManager) -> None:
        self.config = config
        self.runtime = runtime
        self.kv = kv
        self._use_priority = config.policy == "priority"
        self.waiting = WaitingQueue(self._use_priority)
        self.running: list[Request] = []
        # decode tier: reservations waiting for room, in arrival order, each with what to call once made
        self.awaiting_room: dict[str, tuple[Request, Callable[[int], None]]] = {}
        self.awaiting_kv: dict[str, Request] = {}  # decode tier: KV in flight from a prefill worker
        self.held: dict[str, Request] = {}  # prefill tier: finished, blocks kept until sent
        self.requests: dict[str, Request] = {}  # every unfinished request (awaiting_kv included)
        self.stats = SchedulerStats()
        self._pinned: set[str] = set()  # awaiting_kv requests whose blocks a transfer writes (pin_reserved)
        self._pin_lock = threading.Lock()  # pin_reserved runs beside the step thread

    # -- queue changes ------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self._check_unused(request.request_id)
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def finish_request(self, request_id: str, status: RequestStatus, keep_blocks: bool = False) -> Request | None:
        """Finish (or abort) a request now and free its blocks at once (or hold them: prefill tier)."""
        request = self.requests.pop(request_id, None)
        if request is None:
            queued = self.awaiting_room.pop(request_id, None)
            if queued is not None:
                queued[0].status = status
            return None if queued is None else queued[0]
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status == RequestStatus.AWAITING_KV:
            self._drop_reservation(request)
            request.status = status
            return request
        else:
            self.waiting.remove(request)
        request.status = status
        if keep_blocks:
            self.held[request_id] = request
        else:
            self.kv.free(request)
        return request

    def _check_unused(self, request_id: str) -> None:
        if request_id in self.requests or request_id in self.awaiting_room:
            raise ValueError(f"request id {request_id!r} is already in use")

    def release_held(self, request_id: str) -> bool:
        """Free the blocks a finished prefill-tier request kept for its KV transfer."""
        request = self.held.pop(request_id, None)
        if request is not None:
            self.kv.free(request)
        return request is not None

    # -- decode tier: KV arriving from a prefill worker ---------------------------------------
    def reserve_for_transfer(self, request: Request) -> int | None:
        """Reserve blocks for the whole prompt before any KV moves; park the request in awaiting_kv.

        Returns how many leading prompt blocks are already here (prefix hits: not transferred),
        or None, changing nothing, when the pool cannot hold the prompt now with headroom to spare.

        Headroom: afterwards one block must stay free per request holding blocks, this one
        included: the next block a running decode grows into, or the one an admitted request's
        first token may need. Reserved and landed requests cannot be preempted, so without it
        reservations could fill the pool with requests that can never take their next block.
        With it, blocks not held by waiting or awaiting requests always number at least those
        requests, so when nothing runs one of them can (see _schedule_waiting): no deadlock.
        """
        self._check_unused(request.request_id)
        return self._reserve(request)

    def _reserve(self, request: Request) -> int | None:
        hit = self.kv.find_prefix_hit(request)
        num_keep_free = self._num_holding_blocks() + 1
        if not self.kv.allocate_slots(request, request.num_tokens - hit.num_tokens, hit, num_keep_free):
            return None
        request.num_cached_tokens = hit.num_tokens
        self.stats.prefix_cache_queries += request.num_tokens
        self.stats.prefix_cache_hits += hit.num_tokens
        request.status = RequestStatus.AWAITING_KV
        self.requests[request.request_id] = request
        self.awaiting_kv[request.request_id] = request
        return len(hit.blocks)

    def queue_reservation(self, request: Request, reserved: Callable[[int], None]) -> None:
        """Reserve as reserve_for_transfer does, now or once room is freed (reserve_queued), after
        the reservations queued before it; reserved(num_held) is called once it is made."""
        self._check_unused(request.request_id)
        self.awaiting_room[request.request_id] = (request, reserved)
        self.reserve_queued()

    def reserve_queued(self) -> None:
        """Make the queued reservations that fit now, in arrival order (one that does not fit holds
        the rest back: a large prompt is not starved by small ones)."""
        while self.awaiting_room:
            request, reserved = next(iter(self.awaiting_room.values()))
            num_held = self._reserve(request)
            if num_held is None:
                return
            del self.awaiting_room[request.request_id]
            reserved(num_held)

    def admit_transferred(self, request_id: str) -> None:
        """The prompt's KV landed in the reserved blocks (every write to them has ended): the prompt
        counts as computed."""
        with self._pin_lock:
            request = self.awaiting_kv.pop(request_id)
            self._pinned.discard(request_id)
        request.num_computed_tokens = request.num_prompt_tokens
        self.kv.cache_blocks(request)
        _stamp_landing(request)
        self._requeue(request)

    def recompute_locally(self, request_id: str) -> None:
        """The transfer failed after the first token went out: drop the reservation (parked while a
        transfer may still write it), prefill here."""
        request = self.awaiting_kv[request_id]
        self._drop_reservation(request)
        request.num_computed_tokens = 0
        _stamp_landing(request)
        self._requeue(request)

    # Pins: a transfer that writes a reservation's blocks as they arrive (not between steps) pins them
    # first; whatever ends the reservation meanwhile (an abort, a stop at the first token, a failed
    # transfer's recompute) parks its blocks instead of freeing them, until unpin: no other request
    # gets them while bytes may still land there.
    def pin_reserved(self, request_id: str) -> bool:
        """Thread-safe (the transfer's side, not the step thread): False if the reservation is gone."""
        with self._pin_lock:
            if request_id not in self.awaiting_kv:
                return False
            self._pinned.add(request_id)
            return True

    def _drop_reservation(self, request: Request) -> None:
        """Out of awaiting_kv, its blocks freed, or parked while a transfer may still write them."""
        with self._pin_lock:
            del self.awaiting_kv[request.request_id]
            if request.request_id in self._pinned:
                self.kv.park(request)
            else:
                self.kv.free(request)

    def unpin(self, request_id: str) -> None:
        """Every write to the reservation's blocks has ended: parked blocks go back to the pool."""
        with self._pin_lock:
            self._pinned.discard(request_id)
            self.kv.free_parked(request_id)

    def _num_holding_blocks(self) -> int:
        """Unfinished requests holding blocks: running, awaiting KV, or landed and waiting."""
        return sum(1 for request_id in self.requests if self.kv.holds(request_id))

    def _requeue(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.add(request, landed=self.kv.holds(request.request_id))

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def has_work(self) -> bool:
        """Whether a step could schedule anything (requests awaiting KV cannot run yet)."""
        return bool(self.running) or bool(self.waiting)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # -- scheduling -----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(self.kv)
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        out.chunks.sort(key=lambda s: s.num_new_tokens != 1)  # one-token chunks next to the decodes
        out.block_table = self.kv.block_table(out.request_ids())
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        if len(self.running) <= budget and self._schedule_all_decodes(out):
            return budget - len(self.running)
        bs, kv = self.kv.block_size, self.kv
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            computed, num_tokens = request.num_computed_tokens, len(request.all_token_ids)
            num_new = min(num_tokens - computed, budget)
            # A request holds blocks for all its computed tokens, so one more token that does not
            # start a block needs none: the pool is asked only at block boundaries and for prefills.
            if (num_new == 1 and computed % bs) or kv.allocate_slots(request, num_new):
                self._add_scheduled(out, request, num_new, computed + num_new == num_tokens)
                budget -= num_new
                i += 1
                continue
            victim = max(self.running, key=lambda r: service_key(r, self._use_priority))
            victim_index = self.running.index(victim)
            budget += self._preempt(victim, out)
            if victim_index < i:
                i -= 1
            # else: the victim is this request or one not visited yet; index i is still right
        return budget

    def _schedule_all_decodes(self, out: SchedulerOutput) -> bool:
        """The steady state: every running request decodes one token. Only those starting a block
        need the pool, all served at once. False, changing nothing, when that is not the case or
        the pool is short (the general loop then preempts)."""
        running, bs = self.running, self.kv.block_size
        if any(len(r.all_token_ids) - r.num_computed_tokens != 1 for r in running):
            return False
        growing = [r for r in running if r.num_computed_tokens % bs == 0]
        if growing and not self.kv.allocate_next_blocks(growing):
            return False
        out.decodes = running.copy()
        return True

    def _add_scheduled(self, out: SchedulerOutput, request: Request, num_new: int, samples: bool) -> None:
        if num_new == 1 and samples:
            out.decodes.append(request)
        else:
            out.chunks.append(ScheduledRequest(request, num_new, samples, self.kv))

    def _preempt(self, victim: Request, out: SchedulerOutput) -> int:
        """Move victim back to waiting, freeing its blocks; returns the budget it gives back."""
        refund = 0
        if victim in out.decodes:
            out.decodes.remove(victim)
            refund = 1
        for s in out.chunks:
            if s.request is victim:
                out.chunks.remove(s)
                refund = s.num_new_tokens
                break
        self.running.remove(victim)
        self.kv.free(victim)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.add(victim)
        out.preempted.append(victim)
        return refund

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        """Admit waiting requests in queue order; after one that cannot join, only landed ones.

        A landed request (its KV came from a prefill worker) holds its prompt's blocks and needs at
        most one more, for its first token; those blocks come back only by running it, and the
        request that cannot join may be waiting for exactly them. Fresh and preempted requests
        never pass one that cannot join, so a large prompt is not starved by small ones.
        Liveness: when nothing runs, the headroom kept by reserve_for_transfer leaves a free block
        per landed request, so the first one joins.
        """
        blocked = False
        for request in list(self.waiting):
            if budget == 0 or len(self.running) >= self.config.max_num_seqs:
                return
            if blocked and not self.kv.holds(request.request_id):
                return  # only landed requests pass one that cannot join, and they are queued first
            num_new = self._try_admit(request, budget)
            if num_new is None:
                blocked = True
                continue
            self._add_scheduled(out, request, num_new, request.num_computed_tokens + num_new == request.num_tokens)
            budget -= num_new

    def _try_admit(self, request: Request, budget: int) -> int | None:
        """Move request from waiting to running with its blocks; returns its tokens this step.

        None, changing nothing, when the budget (without chunked prefill) or the pool has no room.
        """
        holds = self.kv.holds(request.request_id)  # landed after a KV transfer
        hit = PrefixHit([], self.kv.block_size) if holds else self.kv.find_prefix_hit(request)
        num_new = request.num_tokens - request.num_computed_tokens - hit.num_tokens
        if num_new > budget and not self.config.enable_chunked_prefill:
            return None
        num_new = min(num_new, budget)
        if not self.kv.allocate_slots(request, num_new, hit):
            return None
        self.waiting.remove(request)
        if request.num_preemptions == 0 and request.num_output_tokens == 0:
            request.num_cached_tokens = hit.num_tokens
            self.stats.prefix_cache_queries += request.num_tokens
            self.stats.prefix_cache_hits += hit.num_tokens
        request.num_computed_tokens += hit.num_tokens
        request.status = RequestStatus.RUNNING
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.monotonic()
        self.running.append(request)
        return num_new

    # -- after the forward ----------------------------------------------------------------------
    def update_after_step(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Advance computed tokens, append sampled tokens, finish requests that stop.

        Returns the requests that got a new token this step (finished ones included).
        """
        return self.update(out, [sampled.get(r.request_id) for r in out.sampling_requests()]).advanced

    def update(self, out: SchedulerOutput, token_ids: Sequence[int | None]) -> StepUpdate:
        """update_after_step with the sampled tokens in out.sampling_requests() order (None where a
        request failed), also saying which requests finished."""
        update = StepUpdate([], [])
        self._update_decodes(out.decodes, token_ids, update)
        tokens = iter(token_ids[len(out.decodes) :])
        for s in out.chunks:
            token = next(tokens) if s.samples else None
            request = s.request
            if request.is_finished:  # aborted while the step ran
                continue
            request.num_computed_tokens += s.num_new_tokens
            if token is not None:
                request.append_output_token(token)
            self.kv.cache_blocks(request)
            if token is not None:
                update.advanced.append(request)
                self._maybe_finish(request, update)
        return update

    def _update_decodes(self, decodes: list[Request], token_ids: Sequence[int | None], update: StepUpdate) -> None:
        """The hot loop: one token each. Only a block boundary or a possible stop costs more."""
        bs, max_len, advanced = self.kv.block_size, self.runtime.max_model_len, update.advanced
        for request, token in zip(decodes, token_ids):
            if request.status is not _RUNNING or token is None:  # aborted while the step ran, or failed
                continue
            request.num_computed_tokens += 1
            ids = request.all_token_ids
            ids.append(token)
            num_tokens = len(ids)
            if num_tokens % bs == 0:
                request.extend_block_hashes()
            if request.num_computed_tokens % bs == 0:  # a block became full
                self.kv.cache_blocks(request)
            advanced.append(request)
            if (
                num_tokens >= request.max_num_tokens
                or num_tokens >= max_len
                or token in request.stopping_ids
                or request.stop_after_prefill
            ):
                self._maybe_finish(request, update)

    def _maybe_finish(self, request: Request, update: StepUpdate) -> None:
        status = request.check_stop(self.runtime.max_model_len)
        if status is not None:
            self.finish_request(request.request_id, status, keep_blocks=request.stop_after_prefill)
            update.finished.append(request)


def _stamp_landing(request: Request) -> None:
    """Its KV landed, or it was set to recompute: before it is scheduled again (its stages' clock)."""
    if request.handoff_times is not None:
        request.handoff_times.landed_time = time.monotonic()
