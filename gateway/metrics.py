"""The gateway's Prometheus registry: one set of series for both public APIs (gRPC and HTTP).

Served on the metrics port and, with the HTTP API on, at its /metrics too (the same registry).
Series that only move on failure start at zero, so rate() over them has data before the first one.
"""

from __future__ import annotations

import grpc
from prometheus_client import CollectorRegistry, Counter, Gauge

from splitserve.common.roles import Role
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
