"""Conversions between the splitserve.v1 protos and engine types (torch-free: the gateway uses it)."""

from __future__ import annotations

from splitserve.protos.v1 import generation_pb2 as gen_pb
from splitserve.services.engine.sampling_params import SamplingParams

FINISH_REASONS = {
    "stop": gen_pb.FINISH_REASON_STOP,
    "length": gen_pb.FINISH_REASON_LENGTH,
    "abort": gen_pb.FINISH_REASON_ABORT,
}


def sampling_params_from_proto(sampling: gen_pb.SamplingParameters, stopping: gen_pb.StoppingCriteria,
                               logprobs: int | None) -> SamplingParams:
    """Build (and so validate) SamplingParams; raises ValueError with a readable message."""
    return SamplingParams(
        temperature=sampling.temperature if sampling.HasField("temperature") else 1.0,
        top_p=sampling.top_p if sampling.HasField("top_p") else 1.0,
        top_k=sampling.top_k or None,
        min_p=sampling.min_p,
        seed=sampling.seed if sampling.HasField("seed") else None,
        repetition_penalty=sampling.repetition_penalty if sampling.HasField("repetition_penalty") else 1.0,
        presence_penalty=sampling.presence_penalty,
        frequency_penalty=sampling.frequency_penalty,
        max_tokens=stopping.max_tokens if stopping.HasField("max_tokens") else None,
        min_tokens=stopping.min_tokens,
        stop=tuple(stopping.stop),
        stop_token_ids=tuple(stopping.stop_token_ids),
        ignore_eos=stopping.ignore_eos,
        logprobs=logprobs,
    )


def logprobs_to_proto(entries) -> list[gen_pb.TokenLogprob]:
    return [gen_pb.TokenLogprob(token_id=e.token_id, logprob=e.logprob,
                                top=[gen_pb.TopLogprob(token_id=t, logprob=v) for t, v in e.top])
            for e in entries or ()]
