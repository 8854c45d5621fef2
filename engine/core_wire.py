"""The engine's types to and from the engine-core protos (protos/v1/engine_core.proto), both sides of
the pipe between a worker's serving process and its engine core process."""

from __future__ import annotations

import dataclasses

from splitserve.common.sampling_params import SamplingParams
from splitserve.common.wire import logprobs_from_proto, logprobs_to_proto
from splitserve.engine.handoff_port import EngineLoad
from splitserve.engine.outputs import RequestOutput, RequestTimings
from splitserve.engine.request import FinishReason
from splitserve.engine.step_stats import StepKind, StepTotals
from splitserve.protos.v1 import engine_core_pb2 as pb

# SamplingParams fields whose None the proto carries as "unset" (every other field is always set)
_OPTIONAL_PARAMS = ("top_k", "seed", "max_tokens", "logprobs")


def params_to_proto(params: SamplingParams) -> pb.EngineSamplingParams:
    """Every field, so that the core rebuilds the same SamplingParams (ValueError: a value the wire
    cannot carry, such as a seed beyond 64 bits)."""
    fields = {f.name: getattr(params, f.name) for f in dataclasses.fields(params)}
    return pb.EngineSamplingParams(**{k: v for k, v in fields.items() if v is not None})


def params_from_proto(msg: pb.EngineSamplingParams) -> SamplingParams:
    fields = {f.name: getattr(msg, f.name) for f in dataclasses.fields(SamplingParams)}
    for name in _OPTIONAL_PARAMS:
        if not msg.HasField(name):
            fields[name] = None
    fields["stop"], fields["stop_token_ids"] = tuple(msg.stop), tuple(msg.stop_token_ids)
    return SamplingParams(**fields)


def output_to_proto(out: RequestOutput) -> pb.CoreRequestOutput:
    msg = pb.CoreRequestOutput(
        request_id=out.request_id,
        new_token_ids=out.new_token_ids,
        new_text=out.new_text,
        finished=out.finished,
        finish_reason=out.finish_reason.value if out.finish_reason is not None else "",
        has_logprobs=out.new_logprobs is not None,
        new_logprobs=logprobs_to_proto(out.new_logprobs),
        num_prompt_tokens=out.num_prompt_tokens,
        num_output_tokens=out.num_output_tokens,
        num_cached_tokens=out.num_cached_tokens,
        queue_ms=out.timings.queue_ms,
        ttft_ms=out.timings.ttft_ms,
    )
    if isinstance(out.stop_reason, str):
        msg.stop_string = out.stop_reason
    elif out.stop_reason is not None:
        msg.stop_token_id = out.stop_reason
    if out.error is not None:
        msg.error_kind, msg.error = pb.CORE_ERROR_KIND_REQUEST_FAILED, out.error
    return msg


def output_from_proto(msg: pb.CoreRequestOutput) -> RequestOutput:
    stop = msg.WhichOneof("stop_reason")
    return RequestOutput(
        request_id=msg.request_id,
        new_token_ids=list(msg.new_token_ids),
        new_text=msg.new_text,
        finished=msg.finished,
        finish_reason=FinishReason(msg.finish_reason) if msg.finish_reason else None,
        stop_reason=None if stop is None else getattr(msg, stop),
        new_logprobs=logprobs_from_proto(msg.new_logprobs) if msg.has_logprobs else None,
        num_prompt_tokens=msg.num_prompt_tokens,
        num_output_tokens=msg.num_output_tokens,
        num_cached_tokens=msg.num_cached_tokens,
        timings=RequestTimings(msg.queue_ms, msg.ttft_ms if msg.HasField("ttft_ms") else None),
        error=msg.error if msg.error_kind == pb.CORE_ERROR_KIND_REQUEST_FAILED else None,
    )


def load_to_proto(load: EngineLoad) -> pb.CoreLoad:
    fields = {f.name: getattr(load, f.name) for f in dataclasses.fields(load) if f.name != "steps"}
    steps = [pb.CoreStepTotals(kind=kind.value, **dataclasses.asdict(totals)) for kind, totals in load.steps.items()]
    return pb.CoreLoad(steps=steps, **fields)


def load_from_proto(msg: pb.CoreLoad) -> EngineLoad:
    fields = {f.name: getattr(msg, f.name) for f in dataclasses.fields(EngineLoad) if f.name != "steps"}
    steps = {}
    for s in msg.steps:
        totals = {f.name: getattr(s, f.name) for f in dataclasses.fields(StepTotals)}
        totals["bucket_counts"] = list(s.bucket_counts)
        steps[StepKind(s.kind)] = StepTotals(**totals)
    return EngineLoad(steps=steps, **fields)
