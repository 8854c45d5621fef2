"""The engine's types to and from the engine-core protos (protos/v1/engine_core.proto), both sides of
the pipe between a worker's serving process and its engine core process."""

from __future__ import annotations

import dataclasses
import math

from splitserve.common.wire import logprobs_to_proto
from splitserve.protos.v1 import engine_core_pb2 as pb
from splitserve.services.engine.handoff_port import EngineLoad
from splitserve.services.engine.outputs import Finish, StepTokens
from splitserve.services.engine.request import FinishReason, HandoffTimes
from splitserve.services.engine.sampler import TokenLogprobs
from splitserve.services.engine.step_stats import StepKind, StepTotals


def logprobs_from_proto(entries) -> list[TokenLogprobs]:
    """TokenLogprob protos back to the engine's TokenLogprobs."""
    return [TokenLogprobs(e.token_id, e.logprob, tuple((t.token_id, t.logprob) for t in e.top)) for e in entries]


def step_tokens_to_proto(step: StepTokens, ticket: int) -> pb.CoreStepTokens:
    """A step's tokens, column by column (a step of hundreds is a few list copies)."""
    requests = step.requests
    msg = pb.CoreStepTokens(
        ticket=ticket,
        time=step.time,
        request_ids=[r.request_id for r in requests],
        token_ids=step.token_ids,
        num_cached_tokens=[r.num_cached_tokens for r in requests],
        first_scheduled_times=[
            math.nan if r.first_scheduled_time is None else r.first_scheduled_time for r in requests
        ],
        failed=[pb.CoreFailure(request_id=r.request_id, message=message) for r, message in step.failed],
    )
    for request_id, finish in step.finished.items():
        msg.finished.add(request_id=request_id, reason=finish.reason.value)
        if finish.stop_reason is not None:
            msg.finished[-1].stop_token_id = finish.stop_reason
    for r in requests:
        times = r.handoff_times
        if times is not None and not times.landing_reported:  # its first token's step, then its first after landing
            msg.handoff_times.append(handoff_times_to_proto(r.request_id, times))
            times.landing_reported = times.landed_time is not None
    if step.logprobs is not None:
        for r in requests:
            logprobs = step.logprobs.get(r.request_id)
            if logprobs is not None:
                msg.logprobs.add(request_id=r.request_id, logprobs=logprobs_to_proto([logprobs])[0])
    return msg


def handoff_times_to_proto(request_id: str, times: HandoffTimes) -> pb.CoreHandoffTimes:
    return pb.CoreHandoffTimes(
        request_id=request_id,
        prefill_queue_ms=times.prefill_queue_ms,
        prefill_compute_ms=times.prefill_compute_ms,
        first_token_time=times.first_token_time,
        landed_time=times.landed_time,
    )


def handoff_times_from_proto(msg: pb.CoreHandoffTimes) -> HandoffTimes:
    landed = msg.landed_time if msg.HasField("landed_time") else None
    return HandoffTimes(msg.prefill_queue_ms, msg.prefill_compute_ms, msg.first_token_time, landed)


def finishes_from_proto(msg: pb.CoreStepTokens) -> dict[str, Finish]:
    return {
        f.request_id: Finish(FinishReason(f.reason), f.stop_token_id if f.HasField("stop_token_id") else None)
        for f in msg.finished
    }


def logprobs_from_step_proto(msg: pb.CoreStepTokens) -> dict[str, TokenLogprobs] | None:
    if not msg.logprobs:
        return None
    return {entry.request_id: logprobs_from_proto([entry.logprobs])[0] for entry in msg.logprobs}


def load_to_proto(load: EngineLoad, with_steps: bool = True) -> pb.CoreLoad:
    """with_steps False: the counts only (the step totals, histograms included, cost most of the encoding)."""
    fields = {f.name: getattr(load, f.name) for f in dataclasses.fields(load) if f.name != "steps"}
    if not with_steps:
        return pb.CoreLoad(**fields)
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
