"""The Worker gRPC service: streams its engine core's outputs, aborts on cancel, reports load, and
(by role) serves the Prefill RPC or continues requests prefilled elsewhere (the KV handoffs run in the
core)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from types import SimpleNamespace

import grpc

from splitserve.common.roles import Role
from splitserve.common.tracing import (
    Context,
    Span,
    SpanKind,
    context_from_metadata,
    ended,
    fail,
    request_context,
    steps_in,
    tracer,
)
from splitserve.common.wire import FAILED_PEER_KEY, FINISH_REASONS, logprobs_to_proto, params_from_proto
from splitserve.protos.v1 import engine_core_pb2 as cpb
from splitserve.protos.v1 import generation_pb2 as gen_pb
from splitserve.protos.v1 import worker_pb2 as pb
from splitserve.protos.v1 import worker_pb2_grpc as pb_grpc
from splitserve.services.engine.core_client import CoreRefused, EngineCoreClient
from splitserve.services.engine.engine import RequestOutput
from splitserve.services.engine.step_loop import EngineDead
from splitserve.services.engine.streams import RequestFailed
from splitserve.services.worker.metrics import EngineSnapshot, RequestTiming, WorkerMetrics


def engine_snapshot(port: EngineCoreClient) -> EngineSnapshot:
    load = port.load()  # every field of EngineSnapshot is one of EngineLoad's, by the same name
    return EngineSnapshot(**{f.name: getattr(load, f.name) for f in dataclasses.fields(EngineSnapshot)})


WORKER_SERVICE = pb.DESCRIPTOR.services_by_name["Worker"].full_name

# What the caller gets for the engine's errors: its own bad parameters; a failure of the engine on
# this request only (the worker goes on); or a dead engine loop (retry on another worker).
_ENGINE_ERRORS = (ValueError, RequestFailed, EngineDead)


def _status_of(error: Exception) -> grpc.StatusCode:
    if isinstance(error, RequestFailed):
        return grpc.StatusCode.INTERNAL
    if isinstance(error, EngineDead):
        return grpc.StatusCode.UNAVAILABLE
    return grpc.StatusCode.INVALID_ARGUMENT


def _server_span(
    name: str, request: pb.WorkerGenerateRequest, context: grpc.aio.ServicerContext, role: Role
) -> tuple[Span, Context]:
    """A call's span, a child of the caller's (its traceparent), and the context its work runs in."""
    parent = context_from_metadata(context.invocation_metadata())
    attributes = {
        "splitserve.request_id": request.request_id,
        "splitserve.role": role.value,
        "splitserve.num_prompt_tokens": len(request.prompt_token_ids),
    }
    span = tracer.start_span(name, parent, SpanKind.SERVER, attributes=attributes)
    return span, request_context(span, request.request_id, parent)


def _stages(out: RequestOutput) -> gen_pb.StageTimings:
    """The request's stages on this tier: the decode handoff's, or this engine's queue and compute."""
    if out.stages is not None:
        return gen_pb.StageTimings(**out.stages)
    ttft_ms = out.timings.ttft_ms
    compute_ms = 0.0 if ttft_ms is None else ttft_ms - out.timings.queue_ms
    return gen_pb.StageTimings(prefill_queue_ms=out.timings.queue_ms, prefill_compute_ms=compute_ms)


async def _abort(context: grpc.aio.ServicerContext, span: Span, code: grpc.StatusCode, message: str) -> None:
    """Ends the call with this status, recorded on its span first (ended() does not count the abort)."""
    fail(span, f"{code.name}: {message}")
    await context.abort(code, message)


class WorkerServicer(pb_grpc.WorkerServicer):
    def __init__(self, engine: EngineCoreClient, metrics: WorkerMetrics, role: Role = Role.UNIFIED) -> None:
        """engine: the client of this worker's engine core process, which also runs its KV handoffs."""
        self.engine, self.metrics, self.role = engine, metrics, role
        self.draining = False
        self.request_drain: Callable[[], None] | None = None  # set by the server: starts the drain

    async def Generate(self, request: pb.WorkerGenerateRequest, context: grpc.aio.ServicerContext):
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "this worker is shutting down; retry on another")
        timing = RequestTiming(arrival=time.monotonic())
        span, ctx = _server_span("worker.generate", request, context, self.role)
        with ended(span):
            try:
                async for out in steps_in(ctx, self._outputs(request, context)):
                    yield self._response(out, timing, span)
            except _ENGINE_ERRORS as e:
                await _abort(context, span, _status_of(e), str(e))
            except CoreRefused as e:  # a handoff the core refused or failed (a HandoffError there)
                if e.failed_peer:
                    context.set_trailing_metadata(((FAILED_PEER_KEY, e.failed_peer),))
                await _abort(context, span, grpc.StatusCode[e.code], e.message)

    async def _outputs(self, request: pb.WorkerGenerateRequest, context) -> AsyncIterator[RequestOutput]:
        # Read here for output processing (detokenization, stop strings); the core gets the call as it came.
        params = params_from_proto(request.params)
        if request.prefill_address and self.role is not Role.DECODE:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "this worker is not a decode worker; "
                "send requests with a prefill_address to one started with --mode decode",
            )
        if request.prefill_address and request.HasField("continuation"):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "a continued stream (continuation) is computed here with its tokens so far; "
                "send it without a prefill_address",
            )
        if not request.prefill_address and self.role is Role.PREFILL:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "a prefill worker runs prompts only (the "
                "Prefill RPC); send whole requests to a unified or decode worker",
            )
        # The client's id is a label only: the engine names the request itself, so a reused id can
        # never reach another request's blocks. With a prefill_address, its prompt's KV comes from
        # that prefill worker, then it decodes here.
        async for out in self.engine.generate_call(request, params):
            yield out

    def _response(self, out: RequestOutput, timing: RequestTiming, span: Span) -> pb.WorkerGenerateResponse:
        now = time.monotonic()
        if timing.first_token is None:
            timing.first_token = now
            span.add_event("first token")
        elif timing.last_token is not None:
            self.metrics.observe_token_gap(now - timing.last_token)
        timing.last_token = now
        msg = pb.WorkerGenerateResponse(
            text=out.new_text, token_ids=out.new_token_ids, logprobs=logprobs_to_proto(out.new_logprobs)
        )
        if out.finished:
            timing.finished, timing.queue_s = now, out.timings.queue_ms / 1e3
            reason = out.finish_reason.value if out.finish_reason else "abort"
            self.metrics.observe_finished(timing, out.num_prompt_tokens, out.num_output_tokens, reason)
            msg.finish_reason = FINISH_REASONS[reason]
            msg.stop_reason = "" if out.stop_reason is None else str(out.stop_reason)
            msg.usage.CopyFrom(
                gen_pb.Usage(
                    prompt_tokens=out.num_prompt_tokens,
                    completion_tokens=out.num_output_tokens,
                    cached_prompt_tokens=out.num_cached_tokens,
                )
            )
            msg.queue_ms = out.timings.queue_ms
            msg.stages.CopyFrom(_stages(out))
            span.set_attributes({"splitserve.num_output_tokens": out.num_output_tokens, "splitserve.finish": reason})
        return msg

    async def Prefill(self, request: pb.PrefillRequest, context: grpc.aio.ServicerContext):
        if self.role is not Role.PREFILL:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this worker was not started with --mode prefill")
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "this prefill worker is shutting down")
        span, ctx = _server_span("worker.prefill", request.request, context, self.role)
        with ended(span):
            try:
                async for response in steps_in(ctx, self._prefill(request)):
                    yield response
            except _ENGINE_ERRORS as e:
                await _abort(context, span, _status_of(e), str(e))
            except CoreRefused as e:  # the call failed in the engine core (e.g. its KV transfer: UNAVAILABLE)
                await _abort(context, span, grpc.StatusCode[e.code], e.message)

    async def _prefill(self, request: pb.PrefillRequest) -> AsyncIterator[bytes]:
        """The call's responses as the core encoded them (add_worker_service sends bytes as they are)."""
        timing = RequestTiming(arrival=time.monotonic())
        async for event in self.engine.prefill(request):  # the core validates it
            if event.kind == cpb.CORE_PREFILL_EVENT_KIND_FIRST_TOKEN:
                timing.first_token = timing.finished = time.monotonic()
                timing.queue_s = event.queue_ms / 1e3
                self.metrics.observe_finished(timing, len(request.request.prompt_token_ids), 1, "length")
            yield event.response

    async def Drain(self, request: pb.DrainRequest, context) -> pb.DrainResponse:
        if self.request_drain is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this worker cannot be drained over RPC")
            raise AssertionError("unreachable: abort raises")
        self.request_drain()
        return pb.DrainResponse(draining=True)

    async def Abort(self, request: pb.AbortRequest, context) -> pb.AbortResponse:
        """Aborts every request the client sent with this id (ids are labels, so there may be several)."""
        return pb.AbortResponse(aborted=self.engine.abort_label(request.request_id) > 0)

    async def GetLoad(self, request: pb.GetLoadRequest, context) -> pb.LoadReport:
        load = self.engine.load()  # every field of LoadReport but role is one of EngineLoad's, by the same name
        fields = {f.name: getattr(load, f.name) for f in pb.LoadReport.DESCRIPTOR.fields if f.name != "role"}
        return pb.LoadReport(role=self.role.proto, **fields)


def add_worker_service(servicer: WorkerServicer, server: grpc.aio.Server) -> None:
    """The Worker service as protoc's add_WorkerServicer_to_server registers it, except that Prefill
    streams bytes: each response as the engine core encoded it, never parsed or re-encoded here."""
    handlers: dict[str, grpc.RpcMethodHandler] = {}
    made = SimpleNamespace(
        add_generic_rpc_handlers=lambda _: None, add_registered_method_handlers=lambda _, h: handlers.update(h)
    )
    pb_grpc.add_WorkerServicer_to_server(servicer, made)
    handlers["Prefill"] = handlers["Prefill"]._replace(response_serializer=None)  # type: ignore[attr-defined]
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(WORKER_SERVICE, handlers),))
    server.add_registered_method_handlers(WORKER_SERVICE, handlers)
