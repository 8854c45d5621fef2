"""The gateway's and the workers' /metrics, scraped twice, into an Observation.

Series as gateway/metrics.py and services/worker/metrics.py name them (the tests render them with those classes).
Counters and histograms count what happened between the two scrapes (a worker only in the later one
started from zero; a counter that went down was reset, so its new value is what happened); gauges are
read from the later scrape.
- arrival rate: requests the gateway finished (splitserve_gateway_requests, any code) plus the change
  of splitserve_gateway_requests_in_flight, per second;
- TTFT and ITL p90: the gateway's histograms, interpolated within a bucket as histogram_quantile does;
- mean prompt tokens: splitserve_prompt_tokens / splitserve_request_success of the prefill (or unified)
  workers; mean output tokens: splitserve_generation_tokens / splitserve_request_success of the decode
  (or unified) workers;
- queues: splitserve_num_requests_waiting per tier (and _awaiting_kv at decode); KV: each tier's
  fullest worker's splitserve_kv_cache_usage_perc; transfer: the decode workers' mean
  splitserve_kv_transfer_seconds;
- steps for the profile's refit: each worker's splitserve_engine_step_* counters (services/engine/step_stats.py),
  per kind of step; a point is the interval's mean step of that kind on that worker (seconds, sequences,
  tokens, context and, for prefill, the quadratic attention sum, each divided by the number of steps:
  the features are linear in these sums, so the mean step's features are the mean of the steps'),
  from every worker that ran at least one step of that kind in the interval.
"""

from __future__ import annotations

import math
import time
import urllib.request
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from splitserve.common.roles import Role
from splitserve.common.security import ClusterSecurity
from splitserve.services.engine.step_stats import StepKind
from splitserve.services.planner.policy import Observation
from splitserve.services.planner.profile import Point, decode_features, prefill_step_features

GATEWAY_REQUESTS = "splitserve_gateway_requests_total"
GATEWAY_IN_FLIGHT = "splitserve_gateway_requests_in_flight"
GATEWAY_TTFT = "splitserve_gateway_time_to_first_token_seconds"
GATEWAY_ITL = "splitserve_gateway_inter_token_latency_seconds"
PROMPT_TOKENS = "splitserve_prompt_tokens_total"
GENERATION_TOKENS = "splitserve_generation_tokens_total"
REQUEST_SUCCESS = "splitserve_request_success_total"
WAITING = "splitserve_num_requests_waiting"
AWAITING_KV = "splitserve_num_requests_awaiting_kv"
KV_USAGE = "splitserve_kv_cache_usage_perc"
KV_TRANSFER = "splitserve_kv_transfer_seconds"
STEPS = "splitserve_engine_steps_total"
STEP_SECONDS = "splitserve_engine_step_seconds_total"
STEP_SEQUENCES = "splitserve_engine_step_sequences_total"
STEP_TOKENS = "splitserve_engine_step_tokens_total"
STEP_CONTEXT = "splitserve_engine_step_context_tokens_total"
STEP_ATTENTION2 = "splitserve_engine_step_attention_tokens2_total"
_STEP_SUMS = (STEPS, STEP_SECONDS, STEP_SEQUENCES, STEP_TOKENS, STEP_CONTEXT, STEP_ATTENTION2)
_PROMPT_ROLES = (Role.PREFILL, Role.UNIFIED)  # where a request's prompt tokens are counted once
_OUTPUT_ROLES = (Role.DECODE, Role.UNIFIED)


@dataclass(frozen=True, slots=True)
class Samples:
    """One /metrics text: (sample name, labels) -> value."""

    values: Mapping[tuple[str, frozenset[tuple[str, str]]], float]

    @classmethod
    def parse(cls, text: str) -> Samples:
        return cls(
            {
                (s.name, frozenset(s.labels.items())): s.value
                for family in text_string_to_metric_families(text)
                for s in family.samples
            }
        )

    def total(self, name: str, **labels: str) -> float:
        """The sum over every series of this sample name that has these labels (0 when there is none)."""
        wanted = set(labels.items())
        return sum(v for (n, have), v in self.values.items() if n == name and wanted <= have)

    def buckets(self, histogram: str) -> dict[float, float]:
        """Cumulative counts by upper bound, summed over the histogram's series."""
        counts: dict[float, float] = {}
        for (name, labels), value in self.values.items():
            if name == histogram + "_bucket":
                le = float(dict(labels)["le"])
                counts[le] = counts.get(le, 0.0) + value
        return counts


@dataclass(frozen=True, slots=True)
class WorkerScrape:
    address: str  # its Worker service: what identifies it between scrapes
    role: Role
    samples: Samples


@dataclass(frozen=True, slots=True)
class Scrape:
    time_s: float  # monotonic
    gateway: Samples
    workers: tuple[WorkerScrape, ...]
    # Listed healthy by the gateway, /metrics not read in time (busy): counted as workers, nothing else.
    num_unread: Mapping[Role, int] = field(default_factory=dict)


def counter_delta(now: float, before: float) -> float:
    return now if now < before else now - before  # went down: reset, so all of it is new


def histogram_quantile(q: float, buckets: Mapping[float, float]) -> float | None:
    """q-quantile of a histogram's (delta) cumulative buckets, as Prometheus interpolates; None when empty."""
    total = buckets.get(math.inf, 0.0)
    if total <= 0:
        return None
    rank, lower, below = q * total, 0.0, 0.0
    for le in sorted(buckets):
        if buckets[le] >= rank:
            if math.isinf(le):
                return lower  # above the largest bound: the bound is the most that can be said
            return lower + (le - lower) * (rank - below) / max(buckets[le] - below, 1e-12)
        lower, below = le, buckets[le]
    return lower


def _histogram_delta(now: Samples, before: Samples | None, name: str) -> dict[float, float]:
    after = now.buckets(name)
    if before is None:
        return after
    prior = before.buckets(name)
    if after.get(math.inf, 0.0) < prior.get(math.inf, 0.0):
        return after
    return {le: count - prior.get(le, 0.0) for le, count in after.items()}


def _mean_delta(now: Samples, before: Samples | None, histogram: str) -> float | None:
    count = counter_delta(now.total(histogram + "_count"), before.total(histogram + "_count") if before else 0.0)
    total = counter_delta(now.total(histogram + "_sum"), before.total(histogram + "_sum") if before else 0.0)
    return total / count if count > 0 else None


class _WorkerDeltas:
    """Each live worker's counters over the interval, against its own earlier scrape."""

    def __init__(self, prev: Scrape, cur: Scrape) -> None:
        earlier = {w.address: w.samples for w in prev.workers}
        self.pairs = [(w, earlier.get(w.address)) for w in cur.workers]

    def total(self, name: str, roles: Sequence[Role]) -> float:
        return sum(
            counter_delta(w.samples.total(name), before.total(name) if before else 0.0)
            for w, before in self.pairs
            if w.role in roles
        )

    def mean_ratio(self, name: str, roles: Sequence[Role]) -> float:
        finished = self.total(REQUEST_SUCCESS, roles)
        return self.total(name, roles) / finished if finished > 0 else 0.0


def observe(prev: Scrape, cur: Scrape) -> Observation:
    interval_s = max(cur.time_s - prev.time_s, 1e-9)
    gw, gw_before = cur.gateway, prev.gateway
    finished = counter_delta(gw.total(GATEWAY_REQUESTS), gw_before.total(GATEWAY_REQUESTS))
    arrived = max(0.0, finished + gw.total(GATEWAY_IN_FLIGHT) - gw_before.total(GATEWAY_IN_FLIGHT))
    deltas = _WorkerDeltas(prev, cur)
    prompt, output = (
        deltas.mean_ratio(PROMPT_TOKENS, _PROMPT_ROLES),
        deltas.mean_ratio(GENERATION_TOKENS, _OUTPUT_ROLES),
    )
    by_role = {role: [w.samples for w in cur.workers if w.role is role] for role in Role}
    transfers = [m for w, b in deltas.pairs if w.role is Role.DECODE if (m := _mean_delta(w.samples, b, KV_TRANSFER))]
    return Observation(
        time_s=cur.time_s,
        interval_s=interval_s,
        arrival_rate=arrived / interval_s,
        mean_prompt_tokens=prompt,
        mean_output_tokens=output,
        ttft_p90_s=histogram_quantile(0.9, _histogram_delta(gw, gw_before, GATEWAY_TTFT)),
        itl_p90_s=histogram_quantile(0.9, _histogram_delta(gw, gw_before, GATEWAY_ITL)),
        workers={role: n for role, samples in by_role.items() if (n := len(samples) + cur.num_unread.get(role, 0))},
        num_waiting={role: round(sum(s.total(WAITING) for s in samples)) for role, samples in by_role.items()},
        num_awaiting_kv=round(sum(s.total(AWAITING_KV) for s in by_role[Role.DECODE])),
        kv_usage={role: max((s.total(KV_USAGE) for s in samples), default=0.0) for role, samples in by_role.items()},
        transfer_s=sum(transfers) / len(transfers) if transfers else None,
        prefill_points=_step_points(deltas, StepKind.PREFILL),
        decode_points=_step_points(deltas, StepKind.DECODE),
    )


def _step_points(deltas: _WorkerDeltas, kind: StepKind) -> tuple[Point, ...]:
    """Each worker's mean step of this kind over the interval (none from a worker that ran no such step)."""
    points = []
    for w, before in deltas.pairs:
        sums = {name: _kind_delta(w.samples, before, name, kind) for name in _STEP_SUMS}
        num_steps = sums[STEPS]
        if num_steps < 1 or sums[STEP_SEQUENCES] <= 0:
            continue
        mean = {name: value / num_steps for name, value in sums.items()}
        if kind is StepKind.DECODE:  # decode_features takes the context per sequence
            features = decode_features(mean[STEP_SEQUENCES], sums[STEP_CONTEXT] / sums[STEP_SEQUENCES])
        else:
            features = prefill_step_features(mean[STEP_TOKENS], mean[STEP_ATTENTION2])
        points.append(Point(features, mean[STEP_SECONDS]))
    return tuple(points)


def _kind_delta(now: Samples, before: Samples | None, name: str, kind: StepKind) -> float:
    earlier = before.total(name, kind=kind.value) if before is not None else 0.0
    return counter_delta(now.total(name, kind=kind.value), earlier)


class ClusterScraper:
    """Scrapes a running system: the workers from the gateway's registry (ListWorkers, healthy ones),
    then the gateway's /metrics and each worker's."""

    def __init__(self, gateway: str, gateway_metrics: str, cluster: ClusterSecurity, timeout_s: float = 5.0) -> None:
        self.gateway, self.gateway_metrics, self.cluster, self.timeout_s = gateway, gateway_metrics, cluster, timeout_s

    def scrape(self) -> Scrape:
        """OSError when the gateway's /metrics cannot be read, grpc.RpcError when its registry cannot."""
        from splitserve.protos.v1 import worker_pb2 as pb
        from splitserve.protos.v1 import worker_pb2_grpc as pb_grpc

        with self.cluster.blocking_channel(self.gateway, to_worker=False) as channel:
            listed = pb_grpc.RegistryStub(channel).ListWorkers(pb.ListWorkersRequest(), timeout=self.timeout_s)
        gateway = Samples.parse(self._get(self.gateway_metrics))
        workers, unread = [], Counter[Role]()
        for w in listed.workers:
            role = Role.from_proto(w.role)
            if role is None or not (w.healthy and w.metrics_address):
                continue
            try:
                workers.append(WorkerScrape(w.address, role, Samples.parse(self._get(w.metrics_address))))
            except OSError:  # busy, or stopped since the listing (a drained worker deregisters first)
                unread[role] += 1
        return Scrape(time.monotonic(), gateway, tuple(workers), unread)

    def _get(self, address: str) -> str:
        url = address if "://" in address else f"http://{address}/metrics"
        with urllib.request.urlopen(url, timeout=self.timeout_s) as reply:
            return reply.read().decode()
