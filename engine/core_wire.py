"""The engine's types to and from the engine-core protos (protos/v1/engine_core.proto), both sides of
the pipe between a worker's serving process and its engine core process."""

from __future__ import annotations

import dataclasses
import math

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


def _is_plain(out: RequestOutput) -> bool:
    """A running request's new tokens and text, nothing else: it travels in the columns."""
    return not out.finished and out.new_logprobs is None and out.error is None and out.stop_reason is None


def step_outputs_to_proto(outputs: list[RequestOutput]) -> pb.CoreStepOutputs:
    plain = [o for o in outputs if _is_plain(o)]
    return pb.CoreStepOutputs(
        outputs=[output_to_proto(o) for o in outputs if not _is_plain(o)],
        running_request_ids=[o.request_id for o in plain],
        running_num_new_tokens=[len(o.new_token_ids) for o in plain],
        running_token_ids=[t for o in plain for t in o.new_token_ids],
        running_texts=[o.new_text for o in plain],
        running_num_prompt_tokens=[o.num_prompt_tokens for o in plain],
        running_num_output_tokens=[o.num_output_tokens for o in plain],
        running_num_cached_tokens=[o.num_cached_tokens for o in plain],
        running_queue_ms=[o.timings.queue_ms for o in plain],
        running_ttft_ms=[math.nan if o.timings.ttft_ms is None else o.timings.ttft_ms for o in plain],
    )


def running_outputs_from_proto(msg: pb.CoreStepOutputs) -> list[RequestOutput]:
    """The rows of the columns (the whole outputs: output_from_proto each)."""
    token_ids, outputs, start = list(msg.running_token_ids), [], 0
    rows = zip(
        msg.running_request_ids,
        msg.running_num_new_tokens,
        msg.running_texts,
        msg.running_num_prompt_tokens,
        msg.running_num_output_tokens,
        msg.running_num_cached_tokens,
        msg.running_queue_ms,
        msg.running_ttft_ms,
        strict=True,
    )
    for request_id, n, text, num_prompt, num_output, num_cached, queue_ms, ttft_ms in rows:
        timings = RequestTimings(queue_ms, None if math.isnan(ttft_ms) else ttft_ms)
        new_ids, start = token_ids[start : start + n], start + n
        outputs.append(
            RequestOutput(
                request_id, new_ids, text, False, None, None, None, num_prompt, num_output, num_cached, timings
            )
        )
    return outputs
