"""What crosses between a decode worker and a prefill worker during a handoff, as plain
dataclasses (the gRPC layer maps them to splitserve.v1 messages; unit tests pass them directly)."""

from __future__ import annotations

from dataclasses import dataclass

import grpc
from splitserve.disagg.transfer.base import ChannelSpec
from splitserve.engine.sampler import TokenLogprobs


@dataclass(frozen=True, slots=True)
class HandoffJob:
    """Decode -> prefill: where and what to send."""

    channel: ChannelSpec
    tag: int
    num_skip_blocks: int  # leading prompt blocks the decode worker already holds
    kv_layout: str  # ModelRunner.kv_layout of the decode worker; must equal the prefill worker's


@dataclass(frozen=True, slots=True)
class FirstToken:
    """Prefill -> decode, as soon as the prompt's first token is sampled."""

    token_id: int
    logprobs: TokenLogprobs | None
    sampler_state: bytes | None  # seeded requests: the generator after this sample
    num_blocks: int  # blocks the transfer will carry
    queue_ms: float = 0.0


@dataclass(frozen=True, slots=True)
class TransferDone:
    """Prefill -> decode, once the blocks are sent."""

    num_blocks: int
    num_bytes: int
    checksum: int
    seconds: float


HandoffEvent = FirstToken | TransferDone


class HandoffError(Exception):
    """A handoff that cannot go on: the status the client gets, and the worker to blame, if any."""

    def __init__(self, code: grpc.StatusCode, message: str, failed_peer: str | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.failed_peer = code, message, failed_peer


class HandoffProtocolError(Exception):
    """The prefill worker's events came in an order the handoff does not allow."""
