"""The KV handoff between a decode worker and a prefill worker: its lifecycle (described here and
nowhere else) and what crosses between the two, as plain dataclasses (the gRPC layer maps them to
splitserve.v1 messages in prefill_client.py; unit tests pass them directly).

    decode worker (decode.py)                       prefill worker (prefill.py)
    1. reserve  blocks for the whole prompt
       (prefix hits held here are not sent; no
       room yet: queued in the scheduler, in
       arrival order; none within the reserve
       timeout -> RESOURCE_EXHAUSTED)
    2. plan     the pieces (services/disagg/plan.py: which
       prefill rank sends which KV heads to which
       decode rank), from both tensor-parallel
       sizes (the prefill worker's: GetLoad, once
       per peer); each receiving rank's channel to
       its sending rank, and a tag per piece
    3. ask      Prefill RPC: the request as
       received, the pieces, how many leading      4. check the layout and that the pieces fit
       blocks to skip                                 its size; run the prompt (chunked prefill,
                                                      its own prefix cache) as a request that
                                                      finishes at its first token and keeps its
                                                      blocks (held, under a lease: leases.py)
    5. first token -> to the client at once    <-- FirstToken (token, logprobs, number of
                                                      blocks)
                                                   6. send every piece from its rank (rank 0
    7. land     each receiving rank receives its       itself, a follower by SEND_KV), gathered
       pieces into a staging buffer; every           and checksummed chunk by chunk on the wire;
       checksum checked, then between steps each      once every piece is sent or failed:
       rank writes its pieces into the reserved   <-- TransferDone (bytes, one checksum per
       blocks straight from those buffers            piece, time) at once, and the blocks'
                                                      release queued for between steps (never
                                                      awaited first: the step thread may be in
                                                      the next prompt's forward)
       (COMMIT_KV for a follower): the prompt
       counts as computed, the request joins the
       batch
    8. decode   in the continuous batch

Streaming (--kv-streaming, the default): steps 6 and 7 start before step 5. When the step that
computes the prompt's last chunk is scheduled, the prefill worker claims the prompt's blocks (no
lease), orders each follower rank's pieces (STREAM_KV, before that step reaches it), starts rank
0's and tells the decode worker (SendStarted, the number of blocks); every rank gathers each chunk
of layers as soon as its part of that step has written them (services/engine/layer_progress.py), and the
decode worker, which posted its receives on
SendStarted, writes each chunk into the pinned reserved blocks as it lands. So the wire overlaps
the last chunk's forward, and only the last layers' bytes remain after the first token. If that
step fails, the send fails (the decode worker recomputes) and the sender still releases the blocks.

Two tiers of size 1 make one piece, rank 0 to rank 0 with every head: whole blocks on one channel
(the Prefill RPC's channel and tag, no pieces on the wire). Ranks move their own heads: nothing is
gathered through rank 0 (services/disagg/rank_transfers.py has the followers' side).

Failures:
- before the first token (prefill worker dead, RPC failed or timed out, protocol broken, a plan that
  does not fit its size): the reservation is freed, the client gets UNAVAILABLE naming the prefill
  worker, and the gateway retries once on another pair (the peer's size is asked again next time);
- after it (a sender died, a follower rank of either worker is gone, timeout, checksum mismatch, lease
  expired): any piece failing fails the handoff; the reservation is freed and the prompt
  recomputed on the decode worker; pieces that landed anyway are discarded; the client sees no
  error;
- cancel: decode frees the reservation at once; once the blocks were announced, the receives are
  still posted (so the senders never wait on a receive that will not come) and discarded; the
  prefill worker releases the blocks after sending, or at once if the send had not started.
The landing and the send each run in their own task, so a cancelled RPC never strands either side.
docs/disaggregation.md has the failure table and the transfer layer.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from splitserve.protos.v1 import worker_pb2 as pb
from splitserve.services.disagg.plan import Piece
from splitserve.services.disagg.transfer.base import ChannelSpec
from splitserve.services.engine.sampler import TokenLogprobs


@dataclass(frozen=True, slots=True)
class PieceJob:
    """One piece of a handoff, with where it goes: the receiving rank's channel to the sending rank."""

    piece: Piece
    channel: ChannelSpec
    tag: int  # tells this piece apart from other transfers on its channel


@dataclass(frozen=True, slots=True)
class HandoffJob:
    """Decode -> prefill: what to send, and where."""

    pieces: tuple[PieceJob, ...]  # in plan order (services/disagg/plan.py)
    num_skip_blocks: int  # leading prompt blocks the decode worker already holds
    kv_layout: str  # ModelRunner.kv_layout of the decode worker; must equal the prefill worker's
    decode_size: int = 1  # the decode worker's tensor-parallel size

    @property
    def is_whole_blocks(self) -> bool:
        """One piece, rank 0 to rank 0 of a single decode rank: every head of every block."""
        return self.decode_size == 1 and len(self.pieces) == 1 and self.pieces[0].piece.src_rank == 0


@dataclass(frozen=True, slots=True)
class SendStarted:
    """Prefill -> decode, first, when the KV is streamed: the step computing the prompt's last chunk
    is scheduled and its layers go out as they are written; post the receives now."""

    num_blocks: int  # blocks the transfer will carry


@dataclass(frozen=True, slots=True)
class FirstToken:
    """Prefill -> decode, as soon as the prompt's first token is sampled."""

    token_id: int
    logprobs: TokenLogprobs | None
    num_blocks: int  # blocks the transfer will carry
    queue_ms: float = 0.0  # the prompt's wait on the prefill worker
    compute_ms: float = 0.0  # from first scheduled there to this token


@dataclass(frozen=True, slots=True)
class TransferDone:
    """Prefill -> decode, once the blocks are sent."""

    num_blocks: int
    num_bytes: int  # of every piece
    checksums: tuple[int, ...]  # of each piece as sent (services/disagg/transfer/checksum.py), in the job's order
    seconds: float


HandoffEvent = SendStarted | FirstToken | TransferDone


class HandoffError(Exception):
    """A handoff that cannot go on: the status the client gets, and the worker to blame, if any."""

    def __init__(self, code: grpc.StatusCode, message: str, failed_peer: str | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.failed_peer = code, message, failed_peer


class HandoffProtocolError(Exception):
    """The prefill worker's events came in an order the handoff does not allow."""


class PrefillClient(ABC):
    """How a decode worker reaches prefill workers (gRPC in production, direct calls in tests)."""

    @abstractmethod
    def prefill(self, peer: str, wire: pb.WorkerGenerateRequest, job: HandoffJob) -> AsyncIterator[HandoffEvent]:
        """Stream FirstToken then TransferDone from the prefill worker at peer. wire is the request
        as this worker received it (forwarded as is)."""

    async def tensor_parallel_size(self, peer: str) -> int:
        """The ranks of the prefill worker at peer (what the plan of a handoff needs); a client that
        cannot ask (in-process tests) reaches single-rank workers only."""
        return 1

    async def close(self) -> None:
        """Let go of whatever reaches the prefill workers (their channels)."""
