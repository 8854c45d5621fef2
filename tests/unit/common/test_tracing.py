"""common/tracing.py in process: when tracing is on, W3C propagation over gRPC metadata and HTTP headers,
request contexts that survive being stepped from several tasks, and log lines naming request and trace.
The span tree across real processes is tests/integration/test_tracing_cluster.py."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys

import pytest
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from splitserve.common.tracing import (
    LOG_FORMAT,
    RequestLogContext,
    context_from_headers,
    context_from_metadata,
    ended,
    request_context,
    stage,
    steps_in,
    trace_metadata,
    traces_endpoint,
)


@pytest.mark.parametrize(
    ("flag", "environ", "want"),
    [
        (None, {}, None),  # the default: off
        ("http://collector:4317", {}, "http://collector:4317"),
        (None, {"OTEL_TRACES_EXPORTER": "otlp"}, "http://localhost:4317"),
        (None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"}, "http://c:4317"),
        (None, {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t:4317"}, "http://t:4317"),
        (None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_TRACES_EXPORTER": "none"}, None),
        ("http://collector:4317", {"OTEL_SDK_DISABLED": "true"}, None),
        (None, {"OTEL_TRACES_EXPORTER": "console"}, None),  # only OTLP is shipped
    ],
)
def test_tracing_is_off_unless_a_flag_or_the_standard_variables_ask(flag, environ, want):
    assert traces_endpoint(flag, environ) == want


def _run(code: str, **env: str) -> list[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    out = subprocess.run([sys.executable, "-c", code], env=clean | env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def test_off_sets_up_no_exporter_and_makes_no_span_objects():
    code = (
        "import sys; from opentelemetry import trace; from splitserve.common import tracing\n"
        "t = tracing.setup_tracing('gateway'); span = tracing.tracer.start_span('gateway.generate')\n"
        "print(t.provider is None, type(trace.get_tracer_provider()).__name__, span is trace.INVALID_SPAN,\n"
        "      tracing.trace_metadata(span) == (), any(m.startswith('opentelemetry.sdk') for m in sys.modules))"
    )
    # no provider, the API's proxy, its one shared no-op span, no traceparent sent, the SDK never imported
    assert _run(code) == ["True", "ProxyTracerProvider", "True", "True", "False"]


def test_on_names_the_service_after_the_process():
    code = (
        "from opentelemetry import trace; from splitserve.common import tracing\n"
        "t = tracing.setup_tracing('decode'); span = tracing.tracer.start_span('x')\n"
        "print(t.endpoint, trace.get_tracer_provider().resource.attributes['service.name'], span.is_recording())\n"
        "t.shutdown()"  # nothing exported (the span never ended), so no collector is needed
    )
    out = _run(code, OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:9", OTEL_SERVICE_NAME="other")
    assert out == ["http://127.0.0.1:9", "decode", "True"]


@pytest.fixture
def spans() -> tuple[trace.Tracer, InMemorySpanExporter]:
    """A tracer of its own (the global provider stays the no-op one) and what it exported."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider.get_tracer("test"), exporter


def test_traceparent_round_trips_through_grpc_metadata_and_http_headers(spans):
    tracer, _ = spans
    span = tracer.start_span("gateway.attempt")
    metadata = trace_metadata(span)
    assert [key for key, _ in metadata] == ["traceparent"]
    for ctx in (
        context_from_metadata((("splitserve-join-secret", "s"), *metadata)),
        context_from_headers(dict(metadata)),
    ):
        parent = trace.get_current_span(ctx).get_span_context()
        sent = span.get_span_context()
        assert (parent.trace_id, parent.span_id, parent.is_remote) == (sent.trace_id, sent.span_id, True)
    assert context_from_metadata((("splitserve-join-secret", "s"),)) is None and context_from_headers({}) is None
    assert trace_metadata(trace.INVALID_SPAN) == ()


def _log_context() -> str:
    record = logging.LogRecord("splitserve.decode", logging.WARNING, __file__, 1, "recomputing", None, None)
    RequestLogContext().filter(record)
    return record.request_context


def test_log_lines_in_a_request_name_it_and_its_trace(spans):
    tracer, _ = spans
    span = tracer.start_span("worker.generate")
    trace_id = trace.format_trace_id(span.get_span_context().trace_id)
    token = otel_context.attach(request_context(span, "req-7"))
    try:
        record = logging.LogRecord("splitserve.decode", logging.WARNING, __file__, 1, "recomputing", None, None)
        RequestLogContext().filter(record)
        line = logging.Formatter(LOG_FORMAT).format(record)
    finally:
        otel_context.detach(token)
    assert line.endswith(f" WARNING splitserve.decode [request=req-7 trace={trace_id}]: recomputing")
    assert _log_context() == ""  # outside a request
    # tracing off: the id still shows (the no-op span has no trace id)
    token = otel_context.attach(request_context(trace.INVALID_SPAN, "req-8"))
    try:
        assert _log_context() == " [request=req-8]"
    finally:
        otel_context.detach(token)


def test_steps_run_in_the_request_context_whichever_task_takes_them(spans, caplog):
    """The HTTP API starts a stream in one task and sends it from another; every step must still see the
    request's context, and the caller's context must stay its own."""
    tracer, _ = spans
    span = tracer.start_span("gateway.generate")

    async def stream():
        for _ in range(3):
            yield _log_context()

    async def main() -> tuple[list[str], str]:
        steps = steps_in(request_context(span, "req-1"), stream())
        seen = [await asyncio.create_task(anext(steps)), await asyncio.create_task(anext(steps))]
        seen.append(await anext(steps))
        await steps.aclose()
        return seen, _log_context()

    with caplog.at_level(logging.ERROR):
        seen, outside = asyncio.run(main())
    want = f" [request=req-1 trace={trace.format_trace_id(span.get_span_context().trace_id)}]"
    assert seen == [want] * 3 and outside == ""
    assert "Failed to detach context" not in caplog.text


def test_a_stage_with_tracing_off_makes_nothing_current():
    """This process never turned tracing on: the stage is the shared no-op span, and the current
    context (the request's, with its id for the logs) stays as it was."""
    token = otel_context.attach(request_context(trace.INVALID_SPAN, "req-2"))
    try:
        with stage("decode.reserve", {"splitserve.num_blocks": 1}) as span:
            assert span is trace.INVALID_SPAN and _log_context() == " [request=req-2]"
        with pytest.raises(ValueError), stage("decode.kv_transfer"):
            raise ValueError("passes through")
    finally:
        otel_context.detach(token)


def test_ended_marks_errors_but_not_cancels(spans):
    tracer, exporter = spans
    for error in (ValueError("bad"), asyncio.CancelledError()):
        with pytest.raises(type(error)), ended(tracer.start_span(type(error).__name__)):
            raise error
    failed, cancelled = exporter.get_finished_spans()
    assert failed.status.status_code is StatusCode.ERROR and failed.status.description == "ValueError: bad"
    assert cancelled.status.status_code is StatusCode.UNSET and [e.name for e in cancelled.events] == ["cancelled"]
    early = tracer.start_span("decode.prefill_rpc")
    with ended(early):
        early.end()  # ended by the block (at the last event): not again
    assert len(exporter.get_finished_spans()) == 3
