"""Traces (OpenTelemetry) and the log lines that name a request: one trace per request, across the
gateway, the decode worker, the prefill worker and the KV transfer (docs/observability.md, "Traces").

Off unless asked for, by `--otlp-traces-endpoint URL` or the standard variables (OTEL_TRACES_EXPORTER=otlp,
OTEL_EXPORTER_OTLP_ENDPOINT or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT). Off, no SDK is imported and the API's
no-op tracer hands out one shared non-recording span: a request makes no span objects and nothing is
exported. On, spans go through a BatchSpanProcessor to an OTLP/gRPC collector, flushed at exit.

Propagation: W3C `traceparent` in gRPC metadata (gateway -> worker Generate, decode -> prefill Prefill)
and in HTTP headers (a client of the OpenAI API may send one).

A request's context (its span, and its request id) is attached for one step of its stream at a time
(steps_in), never across a yield: a stream may be stepped from several tasks (the HTTP API starts a
stream in one task and sends it from another), and a context attached in one task cannot be detached
in another. Tasks a step creates (the KV landing, the KV send) inherit it, as asyncio copies contexts.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import os
from collections.abc import AsyncGenerator, AsyncIterator, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

__all__ = [
    "LOG_FORMAT",
    "Context",
    "Span",
    "SpanKind",
    "Tracing",
    "context_from_headers",
    "context_from_metadata",
    "ended",
    "fail",
    "request_context",
    "setup_tracing",
    "stage",
    "steps_in",
    "remote_task_context",
    "trace_carrier",
    "trace_metadata",
    "traces_endpoint",
    "tracer",
]

T = TypeVar("T")
Metadata = tuple[tuple[str, str], ...]

# Resolves to the SDK's tracer once setup_tracing turned tracing on, else to the API's no-op tracer.
tracer = trace.get_tracer("splitserve")

# A log line about a request ends its logger name with " [request=ID trace=TRACE_ID]" (see RequestLogContext).
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s%(request_context)s: %(message)s"
_REQUEST_ID = otel_context.create_key("splitserve-request-id")
_NOT_FAILURES = (grpc.aio.AbortError,)  # a handler aborting the call recorded why first (fail)


@dataclass(frozen=True, slots=True)
class Tracing:
    """What setup_tracing turned on; shutdown() sends the spans still buffered (call it before exiting)."""

    endpoint: str | None  # None: tracing is off
    provider: Any = None  # opentelemetry.sdk.trace.TracerProvider when on

    def shutdown(self) -> None:
        if self.provider is not None:
            self.provider.shutdown()  # flushes the batch processor


def traces_endpoint(flag: str | None, environ: Mapping[str, str] = os.environ) -> str | None:
    """Where spans go: the flag's URL, else the standard variables' (default http://localhost:4317 when
    only OTEL_TRACES_EXPORTER=otlp is set); None when tracing is off (the default)."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    if flag:
        return flag
    exporters = {e.strip() for e in environ.get("OTEL_TRACES_EXPORTER", "").split(",") if e.strip()}
    if "none" in exporters:
        return None
    url = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if url:
        return url
    return "http://localhost:4317" if "otlp" in exporters else None


def setup_tracing(service_name: str, endpoint_flag: str | None = None, level: int = logging.INFO) -> Tracing:
    """Once per process, first thing: logging in LOG_FORMAT (every line about a request names it and its
    trace), and traces to OTLP when asked for (traces_endpoint). service_name: gateway, or the worker's role."""
    logging.basicConfig(level=level, format=LOG_FORMAT)
    for handler in logging.getLogger().handlers:
        handler.addFilter(RequestLogContext())
    endpoint = traces_endpoint(endpoint_flag)
    if endpoint is None:
        return Tracing(None)
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    # Our name wins over OTEL_SERVICE_NAME: one environment often serves a whole cluster (`splitserve up`).
    resource = Resource.create({"service.name": service_name, "service.namespace": "splitserve"})
    provider = TracerProvider(resource=resource)
    # The flag's URL is passed on; otherwise the exporter reads the OTEL_EXPORTER_OTLP_* variables itself.
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint_flag or None)))
    trace.set_tracer_provider(provider)
    logging.getLogger("splitserve.tracing").info("traces of %s go to %s (OTLP/gRPC)", service_name, endpoint)
    return Tracing(endpoint, provider)


class RequestLogContext(logging.Filter):
    """Adds `request_context` to every record: " [request=ID trace=TRACE_ID]" inside a request (either
    part when known), else "". Installed on the handlers, so it sees every logger's records."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_context = _describe_current()
        return True


def _describe_current() -> str:
    parts = []
    request_id = otel_context.get_value(_REQUEST_ID)
    if request_id:
        parts.append(f"request={request_id}")
    span_context = trace.get_current_span().get_span_context()
    if span_context.is_valid:
        parts.append(f"trace={trace.format_trace_id(span_context.trace_id)}")
    return f" [{' '.join(parts)}]" if parts else ""


def request_context(span: Span, request_id: str, parent: Context | None = None) -> Context:
    """The context a request's work runs in: its span as the current one, and its id for the logs."""
    return otel_context.set_value(_REQUEST_ID, request_id[:64], trace.set_span_in_context(span, parent))


async def steps_in(ctx: Context, stream: AsyncIterator[T]) -> AsyncGenerator[T, None]:
    """stream's items, each step of stream (and its closing) run with ctx attached; see the module docstring."""
    try:
        while True:
            token = otel_context.attach(ctx)
            try:
                item = await anext(stream)
            except StopAsyncIteration:
                return
            finally:
                otel_context.detach(token)
            yield item
    finally:
        close = getattr(stream, "aclose", None)
        if close is not None:
            token = otel_context.attach(ctx)
            try:
                await close()
            finally:
                otel_context.detach(token)


@contextmanager
def ended(span: Span) -> Iterator[Span]:
    """Ends span on leaving the block (unless the block ended it first), without making it current, so
    the block may yield. An error raised through it marks the span failed; a cancel or a closed stream
    is an event, not a failure."""
    try:
        yield span
    except (asyncio.CancelledError, GeneratorExit):
        if span.is_recording():
            span.add_event("cancelled")
        raise
    except _NOT_FAILURES:
        raise
    except Exception as e:
        fail(span, f"{type(e).__name__}: {e}")
        raise
    finally:
        if span.is_recording():
            span.end()


@contextmanager
def stage(name: str, attributes: dict[str, Any] | None = None) -> Iterator[Span]:
    """A stage of a request: a child of the current span, current itself inside the block (which must not
    yield), ended after it; an error marks it failed (as ended). Cheaper than the API's
    start_as_current_span when tracing is off: the no-op span is not made current."""
    span = tracer.start_span(name, attributes=attributes)
    if not span.is_recording():
        yield span
        return
    token = otel_context.attach(trace.set_span_in_context(span))
    try:
        with ended(span):
            yield span
    finally:
        otel_context.detach(token)


def fail(span: Span, description: str) -> None:
    if span.is_recording():
        span.set_status(Status(StatusCode.ERROR, description))


def trace_metadata(span: Span) -> Metadata:
    """gRPC metadata carrying span as the parent of the callee's spans (W3C traceparent); () when off."""
    if not span.get_span_context().is_valid:
        return ()
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=trace.set_span_in_context(span))
    return tuple(carrier.items())


def trace_carrier() -> dict[str, str]:
    """The current trace context as W3C headers, to cross a process boundary (an engine core's pipe);
    {} when there is none (tracing off, or outside a request)."""
    if not trace.get_current_span().get_span_context().is_valid:
        return {}
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier


def remote_task_context(carrier: Mapping[str, str], request_id: str) -> contextvars.Context:
    """A context to run a request's task in across a process boundary (an engine core's handoff:
    loop.create_task(..., context=)): the span trace_carrier took as the current one, and the
    request's id for the logs; attached in that context alone, never detached (the task's own)."""
    parent = _extract(dict(carrier)) or otel_context.Context()
    context = contextvars.Context()
    context.run(otel_context.attach, otel_context.set_value(_REQUEST_ID, request_id[:64], parent))
    return context


def context_from_metadata(metadata: Any) -> Context | None:
    """The caller's trace context from a call's invocation metadata; None when it sent none."""
    return _extract({k: v for k, v in metadata or () if k in ("traceparent", "tracestate")})


def context_from_headers(headers: Mapping[str, str]) -> Context | None:
    """The client's trace context from HTTP headers (W3C traceparent); None when it sent none."""
    return _extract({k: headers[k] for k in ("traceparent", "tracestate") if k in headers})


def _extract(carrier: dict[str, str]) -> Context | None:
    return propagate.extract(carrier) if "traceparent" in carrier else None
