"""The Worker gRPC service: streams an AsyncEngine's outputs, aborts on cancel, reports load."""

from __future__ import annotations

import time

import grpc

from splitserve.protos.v1 import generation_pb2 as gen_pb
from splitserve.protos.v1 import worker_pb2 as pb
from splitserve.protos.v1 import worker_pb2_grpc as pb_grpc
from splitserve.services.engine.async_engine import AsyncEngine
from splitserve.services.engine.engine import RequestOutput
from splitserve.services.metrics import EngineSnapshot, RequestTiming, WorkerMetrics
from splitserve.services.wire import FINISH_REASONS, logprobs_to_proto, sampling_params_from_proto


def engine_snapshot(engine: AsyncEngine) -> EngineSnapshot:
    e = engine.engine
    stats = e.scheduler.stats
    return EngineSnapshot(num_running=e.scheduler.num_running, num_waiting=e.scheduler.num_waiting,
                          kv_cache_usage=e.kv_usage(), num_preemptions=stats.num_preemptions,
                          prefix_cache_queries=stats.prefix_cache_queries, prefix_cache_hits=stats.prefix_cache_hits)


class WorkerServicer(pb_grpc.WorkerServicer):
    def __init__(self, engine: AsyncEngine, metrics: WorkerMetrics) -> None:
        self.engine = engine
        self.metrics = metrics
        self.draining = False

    async def Generate(self, request: pb.WorkerGenerateRequest, context: grpc.aio.ServicerContext):
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "this worker is shutting down; retry on another")
        timing = RequestTiming(arrival=time.monotonic())
        try:
            params = sampling_params_from_proto(request.sampling, request.stopping,
                                                request.logprobs if request.HasField("logprobs") else None)
            stream = self.engine.generate(list(request.prompt_token_ids), params,
                                          request.request_id or None, request.priority)
            async for out in stream:
                yield self._response(out, timing)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    def _response(self, out: RequestOutput, timing: RequestTiming) -> pb.WorkerGenerateResponse:
        now = time.monotonic()
        if timing.first_token is None:
            timing.first_token = now
        elif timing.last_token is not None:
            self.metrics.observe_token_gap(now - timing.last_token)
        timing.last_token = now
        msg = pb.WorkerGenerateResponse(text=out.new_text, token_ids=out.new_token_ids,
                                        logprobs=logprobs_to_proto(out.new_logprobs))
        if out.finished:
            timing.finished, timing.queue_s = now, out.timings.get("queue_ms", 0.0) / 1e3
            reason = out.finish_reason.value if out.finish_reason else "abort"
            self.metrics.observe_finished(timing, out.num_prompt_tokens, out.num_output_tokens, reason)
            msg.finish_reason = FINISH_REASONS[reason]
            msg.stop_reason = "" if out.stop_reason is None else str(out.stop_reason)
            msg.usage.CopyFrom(gen_pb.Usage(prompt_tokens=out.num_prompt_tokens,
                                            completion_tokens=out.num_output_tokens,
                                            cached_prompt_tokens=out.num_cached_tokens))
            msg.queue_ms = out.timings.get("queue_ms", 0.0)
        return msg

    async def Abort(self, request: pb.AbortRequest, context) -> pb.AbortResponse:
        known = self.engine.has_request(request.request_id)
        self.engine.abort(request.request_id)
        return pb.AbortResponse(aborted=known)

    async def GetLoad(self, request: pb.GetLoadRequest, context) -> pb.LoadReport:
        e = self.engine.engine
        return pb.LoadReport(num_running=e.scheduler.num_running, num_waiting=e.scheduler.num_waiting,
                             num_free_blocks=e.kv.num_free_blocks, num_total_blocks=e.runner.num_blocks,
                             block_size=e.runtime.block_size)
