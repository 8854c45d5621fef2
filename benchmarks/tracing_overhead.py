"""What tracing costs a request, in process (CPU, prints numbers).

per request  the tracing calls one disaggregated request makes in all three processes together (gateway:
             request, validate, plan, attempt spans and the traceparent; decode worker: its request span
             from the metadata, reserve, Prefill RPC, KV landing, decode; prefill worker: its request
             span, queue and compute after the fact, KV send), the same calls the code makes;
per token    what steps_in adds to each streamed token (the gateway and the decode worker each wrap
             their stream once: two per token).
Each with tracing off (the default: the API's no-op tracer) and on (the SDK with a batch processor
whose exporter drops everything, so no network is timed).

Usage: python benchmarks/tracing_overhead.py [--requests 20000 --tokens 100000]
"""

from __future__ import annotations

import argparse
import asyncio
import time

from opentelemetry import context as otel_context
from opentelemetry import trace

from splitserve.common.tracing import (
    SpanKind,
    context_from_metadata,
    ended,
    request_context,
    stage,
    steps_in,
    trace_metadata,
    tracer,
)

METADATA = (("splitserve-join-secret", "s"), ("user-agent", "grpc-python-asyncio/1.85"))


def gateway_calls(request_id: str) -> tuple:
    span = tracer.start_span("gateway.generate", None, SpanKind.SERVER)
    token = otel_context.attach(request_context(span, request_id))  # what steps_in does for each step
    with stage("gateway.validate"):
        pass
    trace.get_current_span().set_attributes({"splitserve.request_id": request_id, "splitserve.num_prompt_tokens": 40})
    with stage("gateway.plan", {"splitserve.attempt": 0}):
        pass
    attempt = tracer.start_span("gateway.attempt", kind=SpanKind.CLIENT, attributes={"splitserve.services.worker": "w"})
    with ended(attempt):
        metadata = trace_metadata(attempt)
        attempt.add_event("first token")
    otel_context.detach(token)
    span.set_attribute("rpc.grpc.status_code", 0)
    span.end()
    return metadata


def worker_calls(request_id: str, metadata: tuple, prefill: bool) -> tuple:
    parent = context_from_metadata(METADATA + metadata)
    attributes = {"splitserve.request_id": request_id, "splitserve.role": "decode", "splitserve.num_prompt_tokens": 40}
    span = tracer.start_span("worker.generate", parent, SpanKind.SERVER, attributes=attributes)
    token = otel_context.attach(request_context(span, request_id, parent))
    out: tuple = ()
    if prefill:
        now = time.time_ns()
        tracer.start_span("prefill.queue", start_time=now).end(end_time=now)
        tracer.start_span("prefill.compute", start_time=now, attributes={"a": 1}).end(end_time=now)
        with stage("prefill.kv_send", {"splitserve.num_blocks": 5}) as send:
            send.set_attributes({"splitserve.num_bytes": 20480, "splitserve.transfer_ms": 1.0})
    else:
        with stage("decode.reserve") as reserve:
            reserve.set_attributes({"splitserve.num_held_blocks": 0, "splitserve.num_blocks_to_land": 5})
        rpc = tracer.start_span("decode.prefill_rpc", kind=SpanKind.CLIENT, attributes={"splitserve.peer": "p"})
        with ended(rpc):
            out = trace_metadata(rpc)
            rpc.add_event("first token")
        with stage("decode.kv_transfer", {"splitserve.num_blocks": 5}) as landing:
            landing.set_attributes({"splitserve.num_bytes": 20480, "splitserve.transfer_ms": 1.0})
        with ended(tracer.start_span("decode.decode")) as decode:
            decode.set_attribute("splitserve.num_output_tokens", 8)
    otel_context.detach(token)
    span.end()
    return out


def one_request(i: int) -> None:
    request_id = f"{i:032x}"
    metadata = gateway_calls(request_id)
    to_prefill = worker_calls(request_id, metadata, prefill=False)
    worker_calls(request_id, to_prefill, prefill=True)


def per_request_us(num: int) -> float:
    start = time.perf_counter()
    for i in range(num):
        one_request(i)
    return (time.perf_counter() - start) / num * 1e6


async def _tokens(num: int):
    for i in range(num):
        yield i


async def _drain(stream) -> None:
    async for _ in stream:
        pass


def per_token_us(num: int) -> float:
    """steps_in's cost per item, over a bare async generator's (best of 3)."""
    ctx = request_context(tracer.start_span("gateway.generate"), "r")

    def timed(wrap: bool) -> float:
        start = time.perf_counter()
        asyncio.run(_drain(steps_in(ctx, _tokens(num)) if wrap else _tokens(num)))
        return time.perf_counter() - start

    return min(timed(True) - timed(False) for _ in range(3)) / num * 1e6


def turn_on() -> None:
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    class Drop(SpanExporter):
        def export(self, spans):
            return SpanExportResult.SUCCESS

    provider = TracerProvider(resource=Resource.create({"service.name": "bench"}))
    provider.add_span_processor(BatchSpanProcessor(Drop(), max_queue_size=1 << 20))  # keeps every span
    trace.set_tracer_provider(provider)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=20000)
    p.add_argument("--tokens", type=int, default=100000)
    a = p.parse_args()
    print(f"{'tracing':<8}{'per request (3 processes)':>28}{'per token (x2 wrappers)':>26}")
    for label in ("off", "on"):
        if label == "on":
            turn_on()
        request_us = per_request_us(a.requests)
        token_us = 2 * per_token_us(a.tokens)
        print(f"{label:<8}{request_us:>25.1f} us{token_us:>23.2f} us")


if __name__ == "__main__":
    main()
