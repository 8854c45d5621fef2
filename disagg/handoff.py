"""The KV handoff between a decode worker and a prefill worker: its lifecycle (described here and
nowhere else) and what crosses between the two, as plain dataclasses (the gRPC layer maps them to
splitserve.v1 messages in prefill_client.py; unit tests pass them directly).

    decode worker (decode.py)                       prefill worker (prefill.py)
    1. reserve  blocks for the whole prompt
       (prefix hits held here are not sent; no
       room within the reserve timeout ->
       RESOURCE_EXHAUSTED)
    2. ask      Prefill RPC: the request as
       received, the channel, a tag, how many      3. run the prompt (chunked prefill, its own
       leading blocks to skip                         prefix cache) as a request that finishes at
                                                      its first token and keeps its blocks (held,
                                                      under a lease: engine/leases.py)
    4. first token -> to the client at once    <-- FirstToken (token, logprobs, seeded sampler
       (sampler state carried over)                   state, number of blocks)
                                                   5. send the blocks (one message on the pair's
    6. land     receive into a staging buffer,         channel, CRC computed meanwhile), release
       check the CRC, then between steps copy     <-- them; TransferDone (bytes, CRC, time)
       into the reserved blocks: the prompt counts
       as computed and the request joins the batch
    7. decode   in the continuous batch

Failures:
- before the first token (prefill worker dead, RPC failed or timed out, protocol broken): the
  reservation is freed, the client gets UNAVAILABLE naming the prefill worker, and the gateway
  retries once on another pair;
- after it (sender died, timeout, CRC mismatch, lease expired): the reservation is freed and the
  prompt recomputed on the decode worker; the client sees no error;
- cancel: decode frees the reservation at once; once the blocks were announced, the receive is
  still posted (so the sender never waits on a receive that will not come) and discarded; the
  prefill worker releases the blocks after sending, or at once if the send had not started.
The landing and the send each run in their own task, so a cancelled RPC never strands either side.
docs/disaggregation.md has the failure table and the transfer layer.
"""

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
    queue_ms: float = 0.0  # the prompt's wait on the prefill worker
    compute_ms: float = 0.0  # from first scheduled there to this token


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
