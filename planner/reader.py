"""The gateway's and the workers' /metrics, scraped twice, into an Observation.

Series as gateway/metrics.py and worker/metrics.py name them (the tests render them with those classes).
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
- steps for the profile's refit, approximate until workers export per-step series: decode, a worker's
  mean token gap at its mean running batch and the context L + O/2; prefill, a worker's mean prefill time
  per request at the mean prompt length, only from a worker that had nothing waiting at either scrape.
"""

from __future__ import annotations

import math
import time
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from splitserve.common.roles import Role
from splitserve.common.security import ClusterSecurity
from splitserve.planner.policy import Observation
from splitserve.planner.profile import Point, decode_features, prefill_features

GATEWAY_REQUESTS = "splitserve_gateway_requests_total"
GATEWAY_IN_FLIGHT = "splitserve_gateway_requests_in_flight"
GATEWAY_TTFT = "splitserve_gateway_time_to_first_token_seconds"
GATEWAY_ITL = "splitserve_gateway_inter_token_latency_seconds"
PROMPT_TOKENS = "splitserve_prompt_tokens_total"
GENERATION_TOKENS = "splitserve_generation_tokens_total"
REQUEST_SUCCESS = "splitserve_request_success_total"
WAITING = "splitserve_num_requests_waiting"
RUNNING = "splitserve_num_requests_running"
AWAITING_KV = "splitserve_num_requests_awaiting_kv"
KV_USAGE = "splitserve_kv_cache_usage_perc"
WORKER_ITL = "splitserve_inter_token_latency_seconds"
WORKER_PREFILL = "splitserve_request_prefill_time_seconds"
KV_TRANSFER = "splitserve_kv_transfer_seconds"
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

    def total(self, name: str) -> float:
        """The sum over every series of this sample name (0 when there is none)."""
        return sum(v for (n, _), v in self.values.items() if n == name)

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
        workers={role: len(samples) for role, samples in by_role.items() if samples},
        num_waiting={role: round(sum(s.total(WAITING) for s in samples)) for role, samples in by_role.items()},
        num_awaiting_kv=round(sum(s.total(AWAITING_KV) for s in by_role[Role.DECODE])),
        kv_usage={role: max((s.total(KV_USAGE) for s in samples), default=0.0) for role, samples in by_role.items()},
        transfer_s=sum(transfers) / len(transfers) if transfers else None,
        prefill_points=_prefill_points(deltas, prompt),
        decode_points=_decode_points(deltas, prompt + output / 2),
    )


def _decode_points(deltas: _WorkerDeltas, context: float) -> tuple[Point, ...]:
    points = []
    for w, before in deltas.pairs:
        gap_s = _mean_delta(w.samples, before, WORKER_ITL)
        if w.role in _OUTPUT_ROLES and gap_s is not None and before is not None:
            batch = (w.samples.total(RUNNING) + before.total(RUNNING)) / 2
            if batch >= 1:
                points.append(Point(decode_features(batch, context), gap_s))
    return tuple(points)


def _prefill_points(deltas: _WorkerDeltas, prompt_tokens: float) -> tuple[Point, ...]:
    points = []
    for w, before in deltas.pairs:
        if w.role is not Role.PREFILL or before is None or w.samples.total(WAITING) or before.total(WAITING):
            continue
        if (seconds := _mean_delta(w.samples, before, WORKER_PREFILL)) is not None and prompt_tokens >= 1:
            points.append(Point(prefill_features([prompt_tokens]), seconds))
    return tuple(points)


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
        workers = []
        for w in listed.workers:
            role = Role.from_proto(w.role)
            if role is None or not (w.healthy and w.metrics_address):
                continue
            try:
                workers.append(WorkerScrape(w.address, role, Samples.parse(self._get(w.metrics_address))))
            except OSError:  # leaving (drained) between the listing and now: not a worker any more
                continue
        return Scrape(time.monotonic(), gateway, tuple(workers))

    def _get(self, address: str) -> str:
        url = address if "://" in address else f"http://{address}/metrics"
        with urllib.request.urlopen(url, timeout=self.timeout_s) as reply:
            return reply.read().decode()
