"""What a worker does, spelled once: the enum's values are the `--mode` flag, the metric and log
labels and the launcher's tier names; `proto` maps to the wire's WorkerRole."""

from __future__ import annotations

import enum

from splitserve.protos.v1 import worker_pb2 as pb


class Role(enum.Enum):
    UNIFIED = "unified"  # whole requests
    PREFILL = "prefill"  # prompts only (the Prefill RPC), then sends their KV
    DECODE = "decode"  # whole requests, and requests whose prompt a prefill worker computes

    @property
    def proto(self) -> pb.WorkerRole:
        return _TO_PROTO[self]

    @classmethod
    def from_proto(cls, value: int) -> Role | None:
        """None for WORKER_ROLE_UNSPECIFIED or a value this version does not know."""
        return _FROM_PROTO.get(value)


_TO_PROTO = {
    Role.UNIFIED: pb.WORKER_ROLE_UNIFIED,
    Role.PREFILL: pb.WORKER_ROLE_PREFILL,
    Role.DECODE: pb.WORKER_ROLE_DECODE,
}
_FROM_PROTO: dict[int, Role] = {v: k for k, v in _TO_PROTO.items()}
MODES = tuple(role.value for role in Role)
