"""Traces across real processes: a gateway and 1P1D workers export over OTLP/gRPC to a collector run
here; one request's spans form one tree, gateway -> decode worker -> prefill worker -> KV transfer.
The cluster has a join secret, so the traceparent metadata travels beside the secret's."""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from concurrent import futures
from dataclasses import dataclass

import grpc
import pytest
from cluster_helpers import engine_argv, greedy_request, stub, tokens
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from splitserve.common.security import ClusterSecurity
from splitserve.services.launcher.launcher import start_cluster, stop_cluster

SECRET = "tracing-test-secret"
# (service, span, parent span) of one disaggregated request: the tree docs/observability.md shows.
TREE = {
    ("gateway", "gateway.generate", None),
    ("gateway", "gateway.validate", "gateway.generate"),
    ("gateway", "gateway.plan", "gateway.generate"),
    ("gateway", "gateway.attempt", "gateway.generate"),
    ("decode", "worker.generate", "gateway.attempt"),
    ("decode", "decode.reserve", "worker.generate"),
    ("decode", "decode.prefill_rpc", "worker.generate"),
    ("prefill", "worker.prefill", "decode.prefill_rpc"),
    ("prefill", "prefill.queue", "worker.prefill"),
    ("prefill", "prefill.compute", "worker.prefill"),
    ("prefill", "prefill.kv_send", "worker.prefill"),
    ("decode", "decode.kv_transfer", "worker.generate"),
    ("decode", "decode.decode", "worker.generate"),
}


@dataclass(frozen=True, slots=True)
class Span:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str  # "" for a root
    attributes: dict
    start_ns: int = 0
    end_ns: int = 0


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace collector that keeps every span it is sent."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.lock = threading.Lock()

    def Export(self, request, context):
        with self.lock:
            for resource_spans in request.resource_spans:
                service = _attributes(resource_spans.resource.attributes)["service.name"]
                for scope_spans in resource_spans.scope_spans:
                    self.spans += [_span(service, s) for s in scope_spans.spans]
        return trace_service_pb2.ExportTraceServiceResponse()

    def trace(self, trace_id: str, num_spans: int, timeout_s: float = 30.0) -> list[Span]:
        """The spans of trace_id once num_spans of them arrived (every process exports on its own)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self.lock:
                spans = [s for s in self.spans if s.trace_id == trace_id]
            if len(spans) >= num_spans:
                return spans
            time.sleep(0.1)
        return spans

    def trace_ids(self) -> set[str]:
        with self.lock:
            return {s.trace_id for s in self.spans}


def _attributes(pairs) -> dict:
    values = {}
    for kv in pairs:
        value = kv.value
        values[kv.key] = getattr(value, value.WhichOneof("value")) if value.WhichOneof("value") else None
    return values


def _span(service: str, s) -> Span:
    ids = (s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex())
    return Span(service, s.name, *ids, _attributes(s.attributes), s.start_time_unix_nano, s.end_time_unix_nano)


@pytest.fixture(scope="module")
def collector():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    sink = Collector()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(sink, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield sink, f"http://127.0.0.1:{port}"
    finally:
        server.stop(grace=None)


@pytest.fixture(scope="module")
def traced_1p1d(collector, tiny_llama_dir):
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": collector[1],
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_BSP_SCHEDULE_DELAY": "100",  # ms: export soon after each span ends
        "SPLITSERVE_JOIN_SECRET": SECRET,
    }
    children = start_cluster(
        0, engine_argv(tiny_llama_dir), num_prefill=1, num_decode=1, env=env, cluster=ClusterSecurity(SECRET)
    )
    try:
        yield children
    finally:
        stop_cluster(children)


def _tree(spans: list[Span]) -> set[tuple[str, str, str | None]]:
    by_id = {s.span_id: s for s in spans}
    assert len(by_id) == len(spans)
    return {(s.service, s.name, by_id[s.parent_id].name if s.parent_id in by_id else None) for s in spans}


def test_one_request_is_one_trace_across_gateway_decode_prefill_and_transfer(collector, traced_1p1d):
    sink, _ = collector
    prompt = [(5 * j) % 300 + 1 for j in range(40)]  # 5 blocks of 8 tokens: a real transfer
    assert len(tokens(stub(traced_1p1d[0].address), greedy_request(prompt, 8))) == 8
    deadline = time.monotonic() + 30
    while not sink.trace_ids() and time.monotonic() < deadline:
        time.sleep(0.1)
    (trace_id,) = sink.trace_ids()  # nothing else in the cluster makes spans: one request, one trace
    spans = sink.trace(trace_id, len(TREE))
    assert _tree(spans) == TREE and len(spans) == len(TREE)
    (root,) = [s for s in spans if not s.parent_id]  # every other span's parent is in the trace
    assert root.name == "gateway.generate" and root.attributes["rpc.grpc.status_code"] == 0
    assert root.attributes["splitserve.num_prompt_tokens"] == 40
    by_name = {s.name: s for s in spans}
    for name in ("prefill.kv_send", "decode.kv_transfer"):
        assert by_name[name].attributes["splitserve.num_blocks"] == 5
        assert by_name[name].attributes["splitserve.num_bytes"] > 0
    assert by_name["worker.generate"].attributes["splitserve.num_output_tokens"] == 8
    request_id = root.attributes["splitserve.request_id"]
    assert by_name["worker.generate"].attributes["splitserve.request_id"] == request_id
    assert by_name["worker.prefill"].attributes["splitserve.request_id"] == request_id
    for child in traced_1p1d[1:]:  # contexts attached per step, never across tasks
        assert not [line for line in child.log if "Failed to detach context" in line or "ended span" in line]


def test_an_http_client_s_traceparent_is_the_parent_of_the_gateway_span(collector, traced_1p1d):
    sink, _ = collector
    client_trace, client_span = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    body = json.dumps({"prompt": "the quick brown fox", "max_tokens": 4, "temperature": 0}).encode()
    request = urllib.request.Request(
        f"http://{traced_1p1d[0].http}/v1/completions",
        data=body,
        headers={"Content-Type": "application/json", "traceparent": f"00-{client_trace}-{client_span}-01"},
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.status == 200
    spans = sink.trace(client_trace, len(TREE))
    assert {(service, name) for service, name, _ in _tree(spans)} == {(s, n) for s, n, _ in TREE}
    (root,) = [s for s in spans if s.name == "gateway.generate"]
    assert root.parent_id == client_span
