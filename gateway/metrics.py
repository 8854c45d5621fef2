"""The gateway's Prometheus registry: one set of series for both public APIs (gRPC and HTTP).

Served on the metrics port and, with the HTTP API on, at its /metrics too (the same registry).
Series that only move on failure start at zero, so rate() over them has data before the first one.
"""

from __future__ import annotations

import time

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from splitserve.common.roles import Role
from splitserve.common.serving import LATENCY_BUCKETS
from splitserve.gateway.prefix import PrefixIndexMetrics

# The HTTP API's routes (the `route` label) and the statuses its generation routes start at zero with.
HTTP_ROUTES = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/models",
    "/tokenize",
    "/detokenize",
    "/health",
    "/ready",
    "/metrics",
)
HTTP_OTHER_ROUTE = "other"  # a path the API does not serve: one label value, whatever the path
LOCAL_PREFILL_REASONS = ("short_prompt", "prefill_queue", "no_prefill_worker", "migration")  # and their labels
MIGRATION_OUTCOMES = ("resumed", "limit", "too_long", "no_worker")  # splitserve_gateway_migrations' labels
_GENERATION_STATUSES = ("200", "400", "401", "404", "429", "500", "503")


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "splitserve_gateway_requests",
            "Generate requests (gRPC calls, and each of the n samples of an HTTP request) by final gRPC status code.",
            ["code"],
            registry=self.registry,
        )
        self.routed = Counter(
            "splitserve_gateway_routing_decisions",
            "Requests routed, by worker and reason.",
            ["worker", "reason"],
            registry=self.registry,
        )
        self.pending = Gauge("splitserve_gateway_requests_in_flight", "Requests in flight.", registry=self.registry)
        self.prefix = PrefixIndexMetrics(self.registry)
        self.retries = Counter(
            "splitserve_gateway_retries",
            "Requests retried on another worker before any token went out, by the failed worker's role.",
            ["role"],
            registry=self.registry,
        )
        for role in Role:  # at zero from the start: a retry is rare, and rate() needs a series to see one
            self.retries.labels(role=role.value)
        self.migrations = Counter(
            "splitserve_gateway_migrations",
            "Streams whose worker failed after tokens went out, by outcome: resumed on another worker, or "
            "ended UNAVAILABLE (limit: the stream's migrations were used up; too_long: longer than the gateway "
            "tracks; no_worker: no healthy worker left to take it).",
            ["outcome"],
            registry=self.registry,
        )
        for outcome in MIGRATION_OUTCOMES:
            self.migrations.labels(outcome=outcome)
        self.local_prefills = Counter(
            "splitserve_gateway_local_prefills",
            "Requests a decode worker computes whole (its own prefill) in a disaggregated deployment, by reason: "
            "short_prompt and prefill_queue (--local-prefill-max-tokens, --local-prefill-queue), no_prefill_worker "
            "(none healthy), migration (a stream moved off a failed worker).",
            ["reason"],
            registry=self.registry,
        )
        for reason in LOCAL_PREFILL_REASONS:
            self.local_prefills.labels(reason=reason)
        self.denied = Counter(
            "splitserve_gateway_denied_calls",
            "Calls refused before any servicer saw them, by plane (public, internal) and gRPC code.",
            ["plane", "code"],
            registry=self.registry,
        )
        for plane, code in (
            ("public", "UNAUTHENTICATED"),
            ("public", "RESOURCE_EXHAUSTED"),
            ("internal", "UNAUTHENTICATED"),
        ):
            self.denied.labels(plane=plane, code=code)
        self.http_requests = _http_requests(self.registry)
        self.latency = ClientLatency(self.registry)

    def count_denial(self, plane: str, code: grpc.StatusCode) -> None:
        self.denied.labels(plane=plane, code=code.name).inc()

    def count_http(self, path: str, status: int) -> None:
        if path.startswith("/v1/models/"):  # one model's card: the route, not the model name
            path = "/v1/models"
        route = path if path in HTTP_ROUTES else HTTP_OTHER_ROUTE
        self.http_requests.labels(route=route, status=str(status)).inc()


def _http_requests(registry: CollectorRegistry) -> Counter:
    counter = Counter(
        "splitserve_gateway_http_requests",
        "HTTP API responses, by route and HTTP status (a stream counts when its headers go out).",
        ["route", "status"],
        registry=registry,
    )
    for route in HTTP_ROUTES:
        counter.labels(route=route, status="200")
    for route in HTTP_ROUTES[:2]:
        for status in _GENERATION_STATUSES:
            counter.labels(route=route, status=status)
    return counter


# StageTimings' fields without "_ms": the `stage` label of splitserve_gateway_request_stage_seconds.
STAGES = (
    "gateway_queue",
    "prefill_queue",
    "prefill_compute",
    "kv_transfer",
    "decode_queue",
    "first_decode_step",
)


class ClientLatency:
    """Latency as the gateway's clients see it, and where each request's time went by stage."""

    def __init__(self, registry: CollectorRegistry) -> None:
        def histogram(name: str, doc: str, labels: tuple[str, ...] = ()) -> Histogram:
            return Histogram(f"splitserve_gateway_{name}", doc, labels, buckets=LATENCY_BUCKETS, registry=registry)

        self.ttft = histogram("time_to_first_token_seconds", "Arrival at the gateway to the first token leaving it.")
        self.itl = histogram("inter_token_latency_seconds", "Time between two chunks of tokens leaving the gateway.")
        self.tpot = histogram("time_per_output_token_seconds", "(e2e - TTFT) / (output tokens - 1), per request.")
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival at the gateway to the last token leaving it.")
        self.stage = histogram(
            "request_stage_seconds",
            "Each finished request's time by stage (docs/observability.md); decode stages: disaggregated only.",
            ("stage",),
        )
        self._stages = {name: self.stage.labels(stage=name) for name in STAGES}

    def observe_stages(self, stages) -> None:
        """stages: a finished request's splitserve.v1.StageTimings. The decode stages exist only for a
        disaggregated request (its KV moved); a zero there is a real zero (no wait), as is one in the
        stages every request goes through."""
        names = STAGES if stages.kv_transfer_ms > 0 else STAGES[:3]
        for name in names:
            self._stages[name].observe(getattr(stages, f"{name}_ms") / 1e3)

    def clock(self, arrival: float) -> RequestClock:
        return RequestClock(self, arrival)


class RequestClock:
    """One request's token times as its responses leave the gateway."""

    __slots__ = ("latency", "arrival", "first_at", "last_at", "num_tokens")

    def __init__(self, latency: ClientLatency, arrival: float) -> None:
        self.latency, self.arrival = latency, arrival
        self.first_at: float | None = None
        self.last_at = arrival
        self.num_tokens = 0

    def observe(self, response) -> None:
        """response: a splitserve.v1.GenerateResponse on its way to the client."""
        now = time.monotonic()
        if response.token_ids:
            if self.first_at is None:
                self.first_at = now
                self.latency.ttft.observe(now - self.arrival)
            else:
                self.latency.itl.observe(now - self.last_at)
            self.last_at, self.num_tokens = now, self.num_tokens + len(response.token_ids)
        if response.finish_reason:
            self._finished(response, now)

    def _finished(self, response, now: float) -> None:
        self.latency.e2e.observe(now - self.arrival)
        if self.first_at is not None and self.num_tokens > 1:
            self.latency.tpot.observe((now - self.first_at) / (self.num_tokens - 1))
        self.latency.observe_stages(response.timings.stages)
