"""Routing decisions: which workers run one attempt of a request.

With healthy prefill and decode workers, a (prefill, decode) pair: the decode worker gets the
request with the prefill worker's address and runs the handoff. Otherwise one worker that runs
whole requests (unified, or decode when no prefill worker is up). A decode worker also computes the
prompt itself (local prefill, counted by reason) for a migrated stream, and, where LocalPrefill's rules
are on (conditional disaggregation, as Dynamo's disaggregated router), for a prompt short enough that
the transfer would not pay or while every prefill worker's queue is long. The router (router.py) picks
within a tier; the planner looks the prompt up in the prefix index first, and afterwards notes
where the prompt's blocks went, so requests sharing a prefix follow before the worker publishes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from prometheus_client import Counter

from splitserve.common.block_hash import hash_block_tokens
from splitserve.common.roles import Role
from splitserve.gateway.prefix import PrefixIndex
from splitserve.gateway.router import Decision, RouteInput, Router, load
from splitserve.gateway.workers import WorkerHandle, WorkerSet


@dataclass(frozen=True, slots=True)
class LocalPrefill:
    """When a decode worker computes a prompt itself although prefill workers are up (0: rule off).

    max_tokens: prompts with at most this many tokens the decode worker does not already hold;
    min_queue: while every healthy prefill worker has at least this many requests running or queued."""

    max_tokens: int = 0
    min_queue: int = 0

    def __post_init__(self) -> None:
        if self.max_tokens < 0 or self.min_queue < 0:
            raise ValueError(f"local prefill thresholds must be >= 0, got {self.max_tokens}, {self.min_queue}")


@dataclass(frozen=True, slots=True)
class Plan:
    target: Decision  # the worker the tokens stream from
    prefill: Decision | None = None  # the prefill worker the target takes the KV cache from; None: it runs all

    @property
    def prefill_worker(self) -> WorkerHandle | None:
        return self.prefill.worker if self.prefill is not None else None

    @property
    def decisions(self) -> list[Decision]:
        return [self.target] + ([self.prefill] if self.prefill is not None else [])


class Planner:
    def __init__(
        self,
        model_name: str,
        workers: WorkerSet,
        router: Router,
        prefix: PrefixIndex,
        routed: Counter,
        local_prefills: Counter,
        local: LocalPrefill = LocalPrefill(),
    ) -> None:
        self.model_name, self.workers, self.router, self.prefix = model_name, workers, router, prefix
        self.routed = routed  # decisions by worker and reason (the routing-decisions metric)
        self.local_prefills, self.local = local_prefills, local  # by reason (metrics.LOCAL_PREFILL_REASONS)

    async def plan(self, prompt: Sequence[int], avoid: set[str], *, retry: bool, migrated: bool = False) -> Plan | None:
        """A plan among the healthy workers not in avoid (addresses), or None when none can serve.
        migrated: a stream moved off a failed worker, which one worker runs whole (never a pair)."""
        healthy = [w for w in self.workers.healthy(self.model_name) if w.address not in avoid]
        route = await self._route_input(prompt, healthy)
        plan = self._pick(route, healthy, migrated)
        if plan is not None:
            for d in plan.decisions:
                self.routed.labels(worker=d.worker.worker_id, reason=d.reason + ("+retry" if retry else "")).inc()
        return plan

    def can_serve(self) -> bool:
        """Whether plan() would find workers now: a healthy one that streams tokens (not prefill only)."""
        return any(w.role is not Role.PREFILL for w in self.workers.healthy(self.model_name))

    def _pick(self, route: RouteInput, healthy: list[WorkerHandle], migrated: bool) -> Plan | None:
        prefills = [w for w in healthy if w.role is Role.PREFILL]
        decodes = [w for w in healthy if w.role is Role.DECODE]
        reason = self._local_reason(route, prefills, decodes, migrated)
        if reason is None:
            prefill, decode = self.router.pick(prefills, route, "prefill"), self.router.pick(decodes, route, "decode")
            assert prefill is not None and decode is not None  # pick returns None only without candidates
            self._observe_match(route, prefill)
            if route.matched is not None:  # the decode worker will hold the prompt's blocks too
                self.prefix.note_routed(route.block_hashes, decode.worker.address)
            return Plan(decode, prefill)
        target = self.router.pick([w for w in healthy if w.role is not Role.PREFILL], route, "prefill")
        if target is None:
            return None
        if reason and target.worker.role is Role.DECODE:
            self.local_prefills.labels(reason=reason).inc()
        self._observe_match(route, target)
        return Plan(target)

    def _local_reason(
        self, route: RouteInput, prefills: list[WorkerHandle], decodes: list[WorkerHandle], migrated: bool
    ) -> str | None:
        """Why one worker runs the whole request ("" for a unified deployment), None for a pair."""
        if not decodes:
            return ""
        if migrated:
            return "migration"
        if not prefills:
            return "no_prefill_worker"
        rules = self.local
        if rules.max_tokens and _uncached_tokens(route, decodes) <= rules.max_tokens:
            return "short_prompt"
        if rules.min_queue and min(load(w) for w in prefills) >= rules.min_queue:
            return "prefill_queue"
        return None

    async def _route_input(self, prompt: Sequence[int], workers: list[WorkerHandle]) -> RouteInput:
        block_size = next((w.block_size for w in workers if w.block_size), 0)
        if not block_size or not self.router.uses_index:
            return RouteInput(prompt, len(prompt) // block_size if block_size else 0, None)
        hashes = hash_block_tokens(prompt, block_size)
        matched = await self.prefix.matches(hashes, block_size, [w.address for w in workers])
        return RouteInput(prompt, len(hashes), matched, hashes)

    def _observe_match(self, route: RouteInput, decision: Decision | None) -> None:
        if decision is None or route.matched is None:
            return
        self.prefix.metrics.matched.observe(route.matched.get(decision.worker.address, 0))
        self.prefix.note_routed(route.block_hashes, decision.worker.address)


def _uncached_tokens(route: RouteInput, decodes: list[WorkerHandle]) -> int:
    """Prompt tokens that the decode worker holding most of the prompt would still compute."""
    held = max((route.matched or {}).get(w.address, 0) * w.block_size for w in decodes)
    return len(route.prompt_token_ids) - held
