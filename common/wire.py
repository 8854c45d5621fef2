"""Conversions between the splitserve.v1 protos and engine types (torch-free: the gateway uses it)."""

from __future__ import annotations

import dataclasses

from splitserve.common.block_hash import BlockHash
from splitserve.common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from splitserve.common.sampling_params import SamplingParams
from splitserve.protos.v1 import generation_pb2 as gen_pb
from splitserve.protos.v1 import worker_pb2 as wpb

# Trailing metadata a decode worker sets on UNAVAILABLE: the prefill worker the gateway should avoid.
FAILED_PEER_KEY = "splitserve-failed-peer"

# Channels to other workers: a peer restarted on the same address is reachable again within about a
# second (gRPC's default reconnect backoff grows to 120 s, so a cached channel stayed refused for
# seconds after the peer came back).
PEER_CHANNEL_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
)

FINISH_REASONS = {
    "stop": gen_pb.FINISH_REASON_STOP,
    "length": gen_pb.FINISH_REASON_LENGTH,
    "abort": gen_pb.FINISH_REASON_ABORT,
}


def sampling_params_from_public(
    sampling: gen_pb.SamplingParameters, stopping: gen_pb.StoppingCriteria, logprobs: int | None
) -> SamplingParams:
    """The public API's fields (generation.proto) as SamplingParams, built (and so validated) once, at
    the gateway; raises ValueError with a readable message. Every hop after carries params_to_proto's."""
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


# EngineSamplingParams' optional fields whose unset means None (max_tokens: up to the context length);
# its other optional fields, unset, take SamplingParams' defaults.
_NONE_WHEN_UNSET = ("top_k", "seed", "max_tokens", "logprobs")
_SEED_SPAN = 2**64  # the seed is uint64 on every hop (the public API's type)
_OPTIONAL_FIELDS = frozenset(f.name for f in wpb.EngineSamplingParams.DESCRIPTOR.fields if f.has_presence)


def params_to_proto(params: SamplingParams) -> wpb.EngineSamplingParams:
    """Every field, so that each hop rebuilds the same SamplingParams (ValueError: a value the wire
    cannot carry, such as a seed beyond 64 bits)."""
    fields = {f.name: getattr(params, f.name) for f in dataclasses.fields(params)}
    if params.seed is not None:
        fields["seed"] = _wire_seed(params.seed)
    return wpb.EngineSamplingParams(**{k: v for k, v in fields.items() if v is not None})


def _wire_seed(seed: int) -> int:
    """The uint64 the wire carries. A negative seed (the Python API takes what torch takes) is the
    one torch makes of it, seed mod 2^64, so every hop samples as the engine in process would."""
    if not -(2**63) <= seed < _SEED_SPAN:
        raise ValueError(f"seed must be in [-2^63, 2^64), as torch takes it; got {seed}")
    return seed % _SEED_SPAN


def params_from_proto(msg: wpb.EngineSamplingParams) -> SamplingParams:
    """SamplingParams as params_to_proto carried them (ValueError: out of range, from a peer that
    skipped the gateway's validation)."""
    fields = {}
    for f in dataclasses.fields(SamplingParams):
        if f.name not in _OPTIONAL_FIELDS or msg.HasField(f.name):
            fields[f.name] = getattr(msg, f.name)
        elif f.name in _NONE_WHEN_UNSET:
            fields[f.name] = None
    fields["stop"], fields["stop_token_ids"] = tuple(msg.stop), tuple(msg.stop_token_ids)
    return SamplingParams(**fields)


def logprobs_to_proto(entries) -> list[gen_pb.TokenLogprob]:
    return [
        gen_pb.TokenLogprob(
            token_id=e.token_id, logprob=e.logprob, top=[gen_pb.TopLogprob(token_id=t, logprob=v) for t, v in e.top]
        )
        for e in entries or ()
    ]


def kv_events_to_proto(events) -> list[wpb.KVCacheEvent]:
    out = []
    for e in events:
        if isinstance(e, BlockStored):
            out.append(
                wpb.KVCacheEvent(
                    stored=wpb.BlockStoredEvent(
                        block_hashes=list(e.block_hashes),
                        parent_hash=e.parent_hash or b"",
                        token_ids=list(e.token_ids),
                        block_size=e.block_size,
                    )
                )
            )
        elif isinstance(e, BlockRemoved):
            out.append(wpb.KVCacheEvent(removed=wpb.BlockRemovedEvent(block_hashes=list(e.block_hashes))))
        else:
            out.append(wpb.KVCacheEvent(cleared=wpb.AllBlocksClearedEvent()))
    return out


def kv_events_from_proto(messages) -> tuple[KVCacheEvent, ...]:
    out: list[KVCacheEvent] = []
    for m in messages:
        kind = m.WhichOneof("event")
        if kind == "stored":
            s = m.stored
            out.append(
                BlockStored(
                    tuple(BlockHash(h) for h in s.block_hashes),
                    BlockHash(s.parent_hash) or None,
                    tuple(s.token_ids),
                    s.block_size,
                )
            )
        elif kind == "removed":
            out.append(BlockRemoved(tuple(BlockHash(h) for h in m.removed.block_hashes)))
        elif kind == "cleared":
            out.append(AllBlocksCleared())
    return tuple(out)
