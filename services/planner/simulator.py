"""A simulated disaggregated cluster, its step times from a Profile, to drive a policy in a closed loop.

A request's life, in simulated seconds:
  arrival -> prefill queue (of the live prefill worker with the fewest queued prompt tokens)
  -> prefill steps (FCFS, prompts packed up to the token budget and max_num_seqs, chunked beyond it)
  -> KV transfer (transfer_s, to the live decode worker with the fewest requests) -> waiting
  -> running (continuous batching within max_num_seqs and the KV capacity, each request reserving
     prompt + output tokens) -> finished.
TTFT ends with the request's first decode step (the first token leaves the decode worker, as in the real
system); each later step is one ITL sample per sequence in it. Scaling: a new worker takes traffic
startup_s after it is asked for; fewer workers cancels starting ones first (newest first), then drains
live ones (newest first, as the launcher does): a draining worker takes no new request, finishes or
sends what it holds, waits for its transfers in flight (either way) to land, and only then leaves.
No request is ever dropped: `num_arrived == num_finished + num_in_flight` at every moment.
"""

from __future__ import annotations

import enum
import heapq
import itertools
import math
import random
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from splitserve.common.roles import Role
from splitserve.services.planner.policy import Decision, Observation, Policy
from splitserve.services.planner.profile import Point, Profile, decode_features, prefill_features

_MAX_POINTS = 16  # observed steps per tier handed to the policy per interval (for its refit)


@dataclass(frozen=True, slots=True)
class Workload:
    """Poisson arrivals at rate(t) requests/s (thinned from max_rate >= rate(t)); each request's prompt and
    output lengths drawn uniformly within +-50% of the means at its arrival. No arrivals after until_s."""

    rate: Callable[[float], float]
    max_rate: float
    prompt_tokens: Callable[[float], float]
    output_tokens: Callable[[float], float]
    until_s: float = math.inf


@dataclass(frozen=True, slots=True)
class SimConfig:
    profile: Profile
    transfer_s: float = 0.02  # one KV transfer, prefill to decode
    startup_s: float = 20.0  # a new worker takes traffic this long after it is asked for
    seed: int = 0


@dataclass(slots=True, eq=False)
class SimRequest:
    arrival: float
    prompt_tokens: int
    output_tokens: int
    remaining_prompt: int  # prompt tokens still to compute
    remaining_output: int  # output tokens still to generate
    first_token_at: float | None = None
    finished_at: float | None = None


class WorkerState(enum.Enum):
    STARTING = "starting"
    LIVE = "live"
    DRAINING = "draining"
    GONE = "gone"


@dataclass(slots=True, eq=False)
class _Worker:
    tier: Role
    state: WorkerState
    busy: bool = False
    queue: deque[SimRequest] = field(default_factory=deque)  # prefill: FCFS; decode: waiting
    in_step: int = 0  # prefill: requests in the current step
    queued_tokens: int = 0  # prefill: prompt tokens still to compute
    transfers: int = 0  # KV transfers in flight from (prefill) or to (decode) this worker
    running: list[SimRequest] = field(default_factory=list)  # decode
    reserved_tokens: int = 0  # decode: KV held by running requests

    @property
    def idle(self) -> bool:
        return not (self.busy or self.queue or self.running or self.transfers)


@dataclass(slots=True)
class _Interval:
    """What happened since the last observation."""

    num_arrived: int = 0
    prompt_tokens: list[int] = field(default_factory=list)  # of prompts finished (prefill)
    output_tokens: list[int] = field(default_factory=list)  # of requests finished (decode)
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[tuple[float, int]] = field(default_factory=list)  # (step seconds, sequences in it)
    prefill_points: list[Point] = field(default_factory=list)
    decode_points: list[Point] = field(default_factory=list)


class SimCluster:
    def __init__(self, config: SimConfig, workload: Workload, workers: Mapping[Role, int]) -> None:
        self.config, self.workload, self.profile = config, workload, config.profile
        self.rng = random.Random(config.seed)
        self.now = 0.0
        self._events: list[tuple[float, int, Callable[..., None], tuple]] = []
        self._seq = itertools.count()
        self.workers: dict[Role, list[_Worker]] = {Role.PREFILL: [], Role.DECODE: []}
        for tier, count in workers.items():
            self.workers[tier] += [_Worker(tier, WorkerState.LIVE) for _ in range(count)]
        self.num_arrived = self.num_finished = self.num_drained = 0
        self.requests: list[SimRequest] = []
        self._interval, self._observed_at = _Interval(), 0.0
        self._at(self._next_arrival(0.0), self._arrive)

    # -- the event loop ------------------------------------------------------------------------
    def _at(self, t: float, fn: Callable[..., None], *args) -> None:
        if t < math.inf:
            heapq.heappush(self._events, (t, next(self._seq), fn, args))

    def run_until(self, t: float) -> None:
        while self._events and self._events[0][0] <= t:
            self.now, _, fn, args = heapq.heappop(self._events)
            fn(*args)
        self.now = max(self.now, t) if t < math.inf else self.now

    @property
    def num_in_flight(self) -> int:
        return self.num_arrived - self.num_finished

    # -- arrivals and the prefill tier -----------------------------------------------------------
    def _next_arrival(self, t: float) -> float:
        w = self.workload
        while True:
            t += self.rng.expovariate(w.max_rate)
            if t > w.until_s:
                return math.inf
            if self.rng.random() * w.max_rate < w.rate(t):
                return t

    def _arrive(self) -> None:
        w = self.workload
        prompt = max(1, round(w.prompt_tokens(self.now) * self.rng.uniform(0.5, 1.5)))
        output = max(1, round(w.output_tokens(self.now) * self.rng.uniform(0.5, 1.5)))
        request = SimRequest(self.now, prompt, output, prompt, output)
        self.requests.append(request)
        self.num_arrived += 1
        self._interval.num_arrived += 1
        worker = min(self._live(Role.PREFILL), key=lambda x: x.queued_tokens)
        worker.queue.append(request)
        worker.queued_tokens += prompt
        if not worker.busy:
            self._prefill_step(worker)
        self._at(self._next_arrival(self.now), self._arrive)

    def _live(self, tier: Role) -> list[_Worker]:
        live = [x for x in self.workers[tier] if x.state is WorkerState.LIVE]
        if not live:
            raise RuntimeError(f"no live {tier.value} worker: keep at least one per tier")
        return live

    def _prefill_step(self, worker: _Worker) -> None:
        limits = self.profile.limits
        budget, chunks = limits.max_num_batched_tokens, []
        for request in itertools.islice(worker.queue, limits.max_num_seqs):
            if budget == 0:
                break
            chunk = min(request.remaining_prompt, budget)
            chunks.append((request, chunk))
            budget -= chunk
        worker.busy, worker.in_step = bool(chunks), len(chunks)
        if not chunks:
            self._maybe_leave(worker)
            return
        query = [c for _, c in chunks]
        seq = [r.prompt_tokens - r.remaining_prompt + c for r, c in chunks]
        step_s = self.profile.prefill_step_s(query, seq)
        self._interval.prefill_points.append(Point(prefill_features(query, seq), step_s))
        self._at(self.now + step_s, self._prefill_done, worker, chunks)

    def _prefill_done(self, worker: _Worker, chunks: list[tuple[SimRequest, int]]) -> None:
        for request, chunk in chunks:
            request.remaining_prompt -= chunk
            worker.queued_tokens -= chunk
            if request.remaining_prompt == 0:  # only the step's last chunk can be partial: FCFS
                worker.queue.popleft()
                self._interval.prompt_tokens.append(request.prompt_tokens)
                self._send(worker, request)
        self._prefill_step(worker)

    def _send(self, source: _Worker, request: SimRequest) -> None:
        target = min(self._live(Role.DECODE), key=lambda x: len(x.running) + len(x.queue) + x.transfers)
        source.transfers += 1
        target.transfers += 1
        self._at(self.now + self.config.transfer_s, self._landed, source, target, request)

    def _landed(self, source: _Worker, target: _Worker, request: SimRequest) -> None:
        source.transfers -= 1
        target.transfers -= 1
        target.queue.append(request)
        if not target.busy:
            self._decode_step(target)
        self._maybe_leave(source)

    # -- the decode tier -------------------------------------------------------------------------
    def _decode_step(self, worker: _Worker) -> None:
        capacity = self.profile.limits.kv_capacity_tokens or math.inf
        admitted = []
        while worker.queue and len(worker.running) < self.profile.limits.max_num_seqs:
            need = worker.queue[0].prompt_tokens + worker.queue[0].output_tokens
            if worker.running and worker.reserved_tokens + need > capacity:
                break
            request = worker.queue.popleft()
            worker.running.append(request)
            worker.reserved_tokens += need
            admitted.append(request)
        worker.busy = bool(worker.running)
        if not worker.running:
            self._maybe_leave(worker)
            return
        generated = sum(r.prompt_tokens + r.output_tokens - r.remaining_output for r in worker.running)
        context = generated / len(worker.running)
        step_s = self.profile.decode_step_s(len(worker.running), context)
        if len(self._interval.decode_points) < 4 * _MAX_POINTS:
            self._interval.decode_points.append(Point(decode_features(len(worker.running), context), step_s))
        self._at(self.now + step_s, self._decode_done, worker, step_s, admitted)

    def _decode_done(self, worker: _Worker, step_s: float, admitted: list[SimRequest]) -> None:
        for request in admitted:  # their first token leaves now
            request.first_token_at = self.now
            self._interval.ttft_s.append(self.now - request.arrival)
        if len(worker.running) > len(admitted):
            self._interval.itl_s.append((step_s, len(worker.running) - len(admitted)))
        still = []
        for request in worker.running:
            request.remaining_output -= 1
            if request.remaining_output > 0:
                still.append(request)
                continue
            request.finished_at = self.now
            worker.reserved_tokens -= request.prompt_tokens + request.output_tokens
            self.num_finished += 1
            self._interval.output_tokens.append(request.output_tokens)
        worker.running = still
        self._decode_step(worker)

    # -- scaling ---------------------------------------------------------------------------------
    def scale(self, desired: Mapping[Role, int]) -> None:
        for tier, count in desired.items():
            asked = [x for x in self.workers[tier] if x.state in (WorkerState.STARTING, WorkerState.LIVE)]
            for _ in range(count - len(asked)):
                worker = _Worker(tier, WorkerState.STARTING)
                self.workers[tier].append(worker)
                self._at(self.now + self.config.startup_s, self._ready, worker)
            order = {WorkerState.STARTING: 0, WorkerState.LIVE: 1}
            newest_first = sorted(reversed(asked), key=lambda x: order[x.state])  # stable: newest first in each
            for worker in newest_first[: max(0, len(asked) - count)]:
                worker.state = WorkerState.GONE if worker.state is WorkerState.STARTING else WorkerState.DRAINING
                self._maybe_leave(worker)

    def _ready(self, worker: _Worker) -> None:
        if worker.state is WorkerState.STARTING:  # else cancelled while starting
            worker.state = WorkerState.LIVE

    def _maybe_leave(self, worker: _Worker) -> None:
        if worker.state is WorkerState.DRAINING and worker.idle:
            worker.state = WorkerState.GONE
            self.num_drained += 1

    def num_workers(self, tier: Role, *states: WorkerState) -> int:
        return sum(x.state in states for x in self.workers[tier])

    def num_held(self, *states: WorkerState) -> int:
        """Requests that workers in these states (any, when none are given) hold: queued, running, or in
        a KV transfer to them. Every request in flight is held by exactly one worker."""
        held = sum(len(x.queue) for x in self.workers[Role.PREFILL] if not states or x.state in states)
        decode = [x for x in self.workers[Role.DECODE] if not states or x.state in states]
        return held + sum(len(x.queue) + len(x.running) + x.transfers for x in decode)

    # -- what the planner sees -------------------------------------------------------------------
    def observe(self) -> Observation:
        """The interval since the last observe(), as reader.py would report it from /metrics."""
        iv, interval_s = self._interval, max(self.now - self._observed_at, 1e-9)
        self._interval, self._observed_at = _Interval(), self.now
        capacity = self.profile.limits.kv_capacity_tokens or math.inf
        prefill = [x for x in self.workers[Role.PREFILL] if x.state is not WorkerState.GONE]
        decode = [x for x in self.workers[Role.DECODE] if x.state is not WorkerState.GONE]
        asked = (WorkerState.STARTING, WorkerState.LIVE)
        return Observation(
            time_s=self.now,
            interval_s=interval_s,
            arrival_rate=iv.num_arrived / interval_s,
            mean_prompt_tokens=float(np.mean(iv.prompt_tokens)) if iv.prompt_tokens else 0.0,
            mean_output_tokens=float(np.mean(iv.output_tokens)) if iv.output_tokens else 0.0,
            ttft_p90_s=float(np.percentile(iv.ttft_s, 90)) if iv.ttft_s else None,
            itl_p90_s=weighted_percentile(iv.itl_s, 0.9),
            workers={tier: self.num_workers(tier, *asked) for tier in (Role.PREFILL, Role.DECODE)},
            num_waiting={
                Role.PREFILL: sum(len(x.queue) - x.in_step for x in prefill),
                Role.DECODE: sum(len(x.queue) for x in decode),
            },
            num_awaiting_kv=sum(x.transfers for x in decode),
            kv_usage={Role.DECODE: max((x.reserved_tokens / capacity for x in decode), default=0.0)},
            transfer_s=self.config.transfer_s,
            prefill_points=tuple(iv.prefill_points[:: max(1, len(iv.prefill_points) // _MAX_POINTS)]),
            decode_points=tuple(iv.decode_points[:: max(1, len(iv.decode_points) // _MAX_POINTS)]),
        )


def weighted_percentile(samples: list[tuple[float, int]], q: float) -> float | None:
    """The q-quantile of values each counted `weight` times; None without samples."""
    if not samples:
        return None
    values, weights = np.array(sorted(samples)).T
    cumulative = np.cumsum(weights)
    return float(values[np.searchsorted(cumulative, q * cumulative[-1])])


def run_closed_loop(cluster: SimCluster, policy: Policy, duration_s: float, interval_s: float) -> list[Decision]:
    """Every interval: observe, decide, scale. Returns the decisions in order."""
    decisions = []
    for k in range(1, int(duration_s / interval_s + 1e-9) + 1):
        cluster.run_until(k * interval_s)
        decision = policy.decide(cluster.observe())
        cluster.scale(decision.desired())
        decisions.append(decision)
    return decisions
