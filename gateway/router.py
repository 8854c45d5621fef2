"""Routers pick a worker of one tier for a request.

kv-aware (default) scores workers by the prompt blocks they already hold (from the prefix index)
and by their load:

  prefill / unified tier: cost = (1 - hit) + PREFILL_LOAD_WEIGHT * load
      hit  = leading prompt blocks the worker holds / prompt blocks (0..1)
      load = max(requests this gateway has in flight there, running + waiting it last reported)
      One queued request weighs as much as recomputing 10% of the prompt. Guard against the
      cache-affinity pile-up (reported against Dynamo and SGLang): if the cheapest worker's load
      exceeds the least-loaded worker's by SPREAD_MARGIN or more, the least-loaded one gets it.
  decode tier: cost = load + DECODE_KV_WEIGHT * used KV fraction - DECODE_HIT_WEIGHT * hit
      Free KV blocks and a short queue first; holding the prefix (fewer blocks to transfer) only
      breaks near-ties.
Ties go to the next worker in a rotating order, so equal workers share the load. Without an
index answer (backend down) it routes by load alone.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from splitserve.common.block_hash import BlockHash
from splitserve.common.bounded import RecentMap
from splitserve.gateway.workers import WorkerHandle

PREFILL_LOAD_WEIGHT = 0.1
SPREAD_MARGIN = 6
DECODE_KV_WEIGHT = 4.0
DECODE_HIT_WEIGHT = 0.5


@dataclass(frozen=True, slots=True)
class RouteInput:
    prompt_token_ids: Sequence[int]
    num_prompt_blocks: int  # full blocks of the prompt
    matched: Mapping[str, int] | None = None  # worker address -> leading blocks held; None: no index
    block_hashes: Sequence[BlockHash] = ()  # the prompt's full blocks, hashed as the workers do


@dataclass(frozen=True, slots=True)
class Decision:
    worker: WorkerHandle
    reason: str  # for the routing-decisions metric


def load(w: WorkerHandle) -> int:
    return max(w.outstanding, w.load.num_running + w.load.num_waiting)


def hit(w: WorkerHandle, route: RouteInput) -> float:
    if not route.matched or not route.num_prompt_blocks:
        return 0.0
    return route.matched.get(w.address, 0) / route.num_prompt_blocks


class Router(ABC):
    name: str
    uses_index = False  # whether the gateway should look the prompt up before pick()

    def __init__(self) -> None:
        # One turn counter per tier: a shared one advances twice per disaggregated request, so
        # with two workers per tier every tie would go to the same worker.
        self._turns: dict[str, itertools.count] = defaultdict(itertools.count)

    def rotated(self, workers: Sequence[WorkerHandle], tier: str = "prefill") -> list[WorkerHandle]:
        """workers starting at a moving offset: min() over it breaks ties round robin."""
        offset = next(self._turns[tier]) % len(workers)
        return list(workers[offset:]) + list(workers[:offset])

    @abstractmethod
    def pick(self, workers: Sequence[WorkerHandle], route: RouteInput, tier: str) -> Decision | None:
        """The worker for this request among healthy candidates of tier ("prefill" or "decode";
        unified workers count as prefill), or None when there are none."""


class LeastOutstandingRouter(Router):
    """Fewest requests in flight from this gateway, then shortest reported queue."""

    name = "least-outstanding"

    def pick(self, workers, route, tier):
        if not workers:
            return None
        return Decision(min(self.rotated(workers, tier), key=lambda w: (w.outstanding, w.load.num_waiting)), "load")


class RoundRobinRouter(Router):
    """Each worker in turn (a baseline for benchmarks)."""

    name = "round-robin"

    def pick(self, workers, route, tier):
        return Decision(self.rotated(workers, tier)[0], "round_robin") if workers else None


class PrefixAffinityRouter(Router):
    """Sticky by the prompt's first block: each new first block goes to the next worker in turn,
    later prompts with that first block to the same worker. Perfect affinity and balance for a
    workload of a few shared system prompts, blind to load (the benchmark's oracle)."""

    name = "prefix-affinity"

    def __init__(self, max_prompts: int = 65536) -> None:
        super().__init__()
        # first 16 tokens -> slot; bounded: a prompt unused for max_prompts newer ones may move
        self._owner: RecentMap[tuple[int, ...], int] = RecentMap(max_prompts)
        self._slots = itertools.count()

    def pick(self, workers, route, tier):
        if not workers:
            return None
        key = tuple(route.prompt_token_ids[:16])
        slot = self._owner.get(key)
        if slot is None:
            slot = next(self._slots)
            self._owner.set(key, slot)
        ordered = sorted(workers, key=lambda w: w.address)
        return Decision(ordered[slot % len(ordered)], "affinity")

    def num_prompts(self) -> int:
        return len(self._owner)


class KVAwareRouter(Router):
    name = "kv-aware"
    uses_index = True

    def pick(self, workers, route, tier):
        if not workers:
            return None
        candidates = self.rotated(workers, tier)
        if route.matched is None:
            return Decision(min(candidates, key=load), "no_index")
        if tier == "decode":
            best = min(
                candidates, key=lambda w: load(w) + DECODE_KV_WEIGHT * _kv_used(w) - DECODE_HIT_WEIGHT * hit(w, route)
            )
            return Decision(best, "prefix_hit" if hit(best, route) else "load")
        best = min(candidates, key=lambda w: (1.0 - hit(w, route)) + PREFILL_LOAD_WEIGHT * load(w))
        idle = min(candidates, key=load)
        if load(best) - load(idle) >= SPREAD_MARGIN:
            return Decision(idle, "spread")
        return Decision(best, "prefix_hit" if hit(best, route) else "load")


def _kv_used(w: WorkerHandle) -> float:
    total = w.load.num_total_blocks
    return 1.0 - w.load.num_free_blocks / total if total else 0.0


ROUTERS: dict[str, type[Router]] = {
    r.name: r for r in (KVAwareRouter, LeastOutstandingRouter, RoundRobinRouter, PrefixAffinityRouter)
}


def make_router(name: str) -> Router:
    if name not in ROUTERS:
        raise ValueError(f"unknown router {name!r}; available: {sorted(ROUTERS)}")
    return ROUTERS[name]()
