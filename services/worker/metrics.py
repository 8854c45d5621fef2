"""Prometheus metrics of a worker, named as vLLM names them but with the prefix `splitserve_`:
a colon is reserved for recording rules, and prometheus_client escapes it to `_` when Prometheus
negotiates OpenMetrics, so a `splitserve:` name would never reach Prometheus as written.
docs/observability.md maps each name to its vLLM counterpart. Torch-free; engine state is read at
scrape time by a collector."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.utils import floatToGoString

from splitserve.common.serving import LATENCY_BUCKETS, METRIC_PREFIX
from splitserve.services.engine.step_stats import STEP_SECONDS_BUCKETS, StepKind, StepTotals

log = logging.getLogger("splitserve.worker")

PREFIX = METRIC_PREFIX
VLLM_PREFIX = "vllm:"
# The series also exported under vLLM's own names with --vllm-metric-names (their splitserve_ names,
# without the prefix, are vLLM's): what tools and schedulers built for vLLM read.
VLLM_NAMES = frozenset(
    {
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "num_preemptions",
        "prefix_cache_queries",
        "prefix_cache_hits",
        "prompt_tokens",
        "generation_tokens",
        "request_success",
        "time_to_first_token_seconds",
        "inter_token_latency_seconds",
        "request_time_per_output_token_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
        "request_prefill_time_seconds",
        "request_decode_time_seconds",
    }
)


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """What the collector reads from the engine at scrape time."""

    num_running: int
    num_waiting: int
    kv_usage: float  # 0..1
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_awaiting_kv: int = 0  # decode tier: KV in flight from a prefill worker
    num_held_blocks: int = 0  # prefill tier: blocks kept for finished prompts until sent
    num_lease_expiries: int = 0  # prefill tier: held blocks released because nobody claimed them
    num_failed_requests: int = 0  # requests a failed engine step stopped (the worker went on)
    num_total_blocks: int = 0  # KV blocks this worker sized its cache to
    steps: Mapping[StepKind, StepTotals] = field(default_factory=dict)  # by kind; a kind left out: none yet


# (name, help, the EngineSnapshot field), in the order they are exported
_ENGINE_GAUGES = (
    ("num_requests_running", "Requests in the running batch.", "num_running"),
    ("num_requests_waiting", "Requests waiting to be scheduled.", "num_waiting"),
    ("num_requests_awaiting_kv", "Decode tier: requests whose KV is in flight.", "num_awaiting_kv"),
    ("kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full).", "kv_usage"),
    ("num_kv_blocks", "KV blocks in this worker's cache (chosen at start).", "num_total_blocks"),
    ("num_held_kv_blocks", "Prefill tier: KV blocks held for finished prompts until sent.", "num_held_blocks"),
)
_ENGINE_COUNTERS = (
    (
        "kv_lease_expiries",
        "Prefill tier: held prompts released because no sender claimed them in time.",
        "num_lease_expiries",
    ),
    ("engine_failed_requests", "Requests stopped with an error by a failed engine step.", "num_failed_requests"),
    ("num_preemptions", "Preemptions (recompute) so far.", "num_preemptions"),
    ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", "prefix_cache_queries"),
    ("prefix_cache_hits", "Prompt tokens found in the prefix cache.", "prefix_cache_hits"),
)


class _EngineCollector:
    def __init__(self, snapshot: Callable[[], EngineSnapshot], labels: dict[str, str]) -> None:
        self._snapshot = snapshot
        self._labels = labels

    def collect(self):
        s = self._snapshot()
        names, values = list(self._labels), list(self._labels.values())
        for family, table in ((GaugeMetricFamily, _ENGINE_GAUGES), (CounterMetricFamily, _ENGINE_COUNTERS)):
            for name, doc, attribute in table:
                metric = family(PREFIX + name, doc, labels=names)
                metric.add_metric(values, getattr(s, attribute))
                yield metric
        yield from _step_families(s.steps, names, values)


# (name, help, the StepTotals field, the kinds it exists for)
_STEP_COUNTERS = (
    ("engine_steps", "Engine steps run, by kind.", "num_steps", tuple(StepKind)),
    ("engine_step_seconds", "Wall time of engine steps (schedule to update), by kind.", "seconds", tuple(StepKind)),
    ("engine_step_sequences", "Sequences in engine steps, summed over steps.", "num_seqs", tuple(StepKind)),
    ("engine_step_tokens", "Tokens computed by engine steps.", "num_tokens", tuple(StepKind)),
    (
        "engine_step_context_tokens",
        "Tokens in KV after each step, over its sequences, summed over steps.",
        "context_tokens",
        tuple(StepKind),
    ),
    (
        "engine_step_attention_tokens2",
        "Prefill steps: seq_len^2 - start^2 over their sequences, summed (the profile's quadratic attention term).",
        "attention_tokens2",
        (StepKind.PREFILL,),
    ),
)


def _step_families(steps: Mapping[StepKind, StepTotals], names: list[str], values: list[str]) -> Iterator[Metric]:
    """The engine step series, every kind from zero (services/planner/reader.py turns their deltas into steps)."""
    totals = {kind: steps.get(kind) or StepTotals() for kind in StepKind}
    for name, doc, attribute, kinds in _STEP_COUNTERS:
        metric = CounterMetricFamily(PREFIX + name, doc, labels=[*names, "kind"])
        for kind in kinds:
            metric.add_metric([*values, kind.value], getattr(totals[kind], attribute))
        yield metric
    histogram = HistogramMetricFamily(
        PREFIX + "engine_step_duration_seconds", "Wall time of one engine step, by kind.", labels=[*names, "kind"]
    )
    for kind, t in totals.items():
        cumulative, buckets = 0, []
        for bound, count in zip((*STEP_SECONDS_BUCKETS, math.inf), t.bucket_counts):
            cumulative += count
            buckets.append((floatToGoString(bound), cumulative))
        histogram.add_metric([*values, kind.value], buckets, t.seconds)
    yield histogram


class _VllmNames:
    """Copies of the VLLM_NAMES series of some collectors, renamed `vllm:...`, read at scrape time
    (one source of truth: the splitserve_ series). In the Prometheus text format the names stay as
    written; prometheus_client escapes the colon to `_` when a scraper negotiates OpenMetrics."""

    def __init__(self, sources: Sequence) -> None:
        self._sources = sources

    def collect(self) -> Iterator[Metric]:
        for source in self._sources:
            for metric in source.collect():
                name = metric.name.removeprefix(PREFIX)
                if name in VLLM_NAMES:
                    yield _renamed(metric, PREFIX, VLLM_PREFIX)


def _renamed(metric: Metric, old: str, new: str) -> Metric:
    copy = Metric(new + metric.name.removeprefix(old), metric.documentation, metric.type, metric.unit)
    copy.samples = [s._replace(name=new + s.name.removeprefix(old)) for s in metric.samples]
    return copy


def metric_labels(model: str, role: str) -> dict[str, str]:
    """The labels on every series of a worker (its engine core's too)."""
    return {"model_name": model, "role": role}


class CoreMetrics:
    """What the engine core counts itself (a prefill or decode worker's KV handoffs:
    services/disagg/metrics.py), read from it at each scrape and exported as it exposes them."""

    def __init__(self, expose: Callable[[], bytes]) -> None:
        """expose: the core's registry in Prometheus' text format (raises if the core cannot say)."""
        self._expose = expose

    def collect(self) -> Iterator[Metric]:
        try:
            text = self._expose().decode()
        except Exception as e:  # a dead or stalled core: the scrape has the worker's own series
            log.warning("the engine core's metrics could not be read (%s: %s)", type(e).__name__, e)
            return
        yield from text_string_to_metric_families(text)


class WorkerMetrics:
    """Per-request latency histograms and token counters, plus the engine collector."""

    def __init__(
        self,
        model: str,
        role: str,
        snapshot: Callable[[], EngineSnapshot],
        registry: CollectorRegistry | None = None,
        vllm_names: bool = False,
    ) -> None:
        """vllm_names: also export VLLM_NAMES as vLLM names them (`vllm:` prefix, same labels)."""
        self.registry = registry or CollectorRegistry()
        self.labels = metric_labels(model, role)
        names = list(self.labels)

        def hist(name: str, doc: str) -> Histogram:
            return Histogram(PREFIX + name, doc, names, buckets=LATENCY_BUCKETS, registry=self.registry)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, doc, names + list(extra), registry=self.registry)

        self.ttft = hist("time_to_first_token_seconds", "Time to first token.")
        self.itl = hist("inter_token_latency_seconds", "Time between consecutive output tokens.")
        self.tpot = hist("request_time_per_output_token_seconds", "(E2E - TTFT) / (output tokens - 1).")
        self.e2e = hist("e2e_request_latency_seconds", "End-to-end request latency.")
        self.queue = hist("request_queue_time_seconds", "Time waiting before first being scheduled.")
        self.prefill = hist("request_prefill_time_seconds", "From first schedule to first token.")
        self.decode = hist("request_decode_time_seconds", "From first token to the last.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.request_success = counter("request_success", "Finished requests.", ("finished_reason",))
        engine = _EngineCollector(snapshot, self.labels)
        self.registry.register(engine)
        self._start_at_zero()
        if vllm_names:
            per_request = (self.ttft, self.itl, self.tpot, self.e2e, self.queue, self.prefill, self.decode)
            counts = (self.prompt_tokens, self.generation_tokens, self.request_success)
            self.registry.register(_VllmNames((engine, *per_request, *counts)))

    def _start_at_zero(self) -> None:
        """Create every series at zero, so that a rate() over one that moved before the first scrape
        has data from the start."""
        for h in (self.ttft, self.itl, self.tpot, self.e2e, self.queue, self.prefill, self.decode):
            h.labels(**self.labels)
        for c in (self.prompt_tokens, self.generation_tokens):
            c.labels(**self.labels)

    def observe_finished(
        self, t: RequestTiming, num_prompt_tokens: int, num_output_tokens: int, finish_reason: str
    ) -> None:
        lab = self.labels
        self.e2e.labels(**lab).observe(t.finished - t.arrival)
        self.queue.labels(**lab).observe(t.queue_s)
        if t.first_token is not None:
            self.ttft.labels(**lab).observe(t.first_token - t.arrival)
            self.prefill.labels(**lab).observe(max(0.0, t.first_token - t.arrival - t.queue_s))
            self.decode.labels(**lab).observe(t.finished - t.first_token)
            if num_output_tokens > 1:
                self.tpot.labels(**lab).observe((t.finished - t.first_token) / (num_output_tokens - 1))
        self.prompt_tokens.labels(**lab).inc(num_prompt_tokens)
        self.generation_tokens.labels(**lab).inc(num_output_tokens)
        self.request_success.labels(**lab, finished_reason=finish_reason).inc()

    def observe_token_gap(self, seconds: float) -> None:
        self.itl.labels(**self.labels).observe(seconds)


@dataclass(slots=True)
class RequestTiming:
    """Monotonic timestamps of one request as seen by the worker's RPC."""

    arrival: float
    first_token: float | None = None
    last_token: float | None = None
    finished: float = 0.0
    queue_s: float = 0.0
