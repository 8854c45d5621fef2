"""The KV transfer contract, split by role.

A transfer moves one contiguous tensor of blocks ([num_layers, 2, num_blocks, block_size,
num_heads, head_dim]: a piece's KV heads, as ModelRunner.read_heads makes it; every head when both
workers have one rank) from a prefill rank to a preallocated buffer of the same shape and dtype on
a decode rank. Transfers ride a channel between one receiving and one sending process (a worker,
or one of its tensor-parallel ranks: services/disagg/rank_transfers.py); the receiver names the channel
(ChannelSpec, sent to the sender inside the handoff RPC) and a tag that tells concurrent transfers
apart.

Integrity: send and recv each return the checksum (services/disagg/transfer/checksum.py) of the bytes as that
side sent or received them, computed chunk by chunk while they move; the caller compares the two
(the prefill worker reports its own in TransferDone) and fails the handoff with "checksum" when they
differ.

Trust: a channel carries a secret that only the handoff RPC carries. A transport admits a peer
onto a channel only once it has shown it holds that secret, and fails the channel with "auth"
otherwise; no byte from a peer that has not is ever written into a receiver's buffer.

Failure contract: every operation is bounded by the transport's timeout and raises TransferError
with a reason. A channel that failed with "peer_lost" or "timeout" is dead on both sides; the
receiver drops it and the next channel_for() builds a new one.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

import torch


class TransferFailure(enum.Enum):
    """Why a KV handoff failed; the values are the `reason` label of kv_transfer_failures_total."""

    CONNECT = "connect"  # the pair's group could not be built
    PEER_LOST = "peer_lost"  # the other side went away mid-transfer
    TIMEOUT = "timeout"
    CHECKSUM = "checksum"  # the bytes arrived but differ from what was sent
    CLOSED = "closed"  # the channel was dropped earlier, or the held KV is gone
    PREFILL_FAILED = "prefill_failed"  # the prefill worker's RPC failed or broke the protocol
    AUTH = "auth"  # the peer on the channel could not show it holds the channel's secret

    @property
    def drops_channel(self) -> bool:
        """Whether the pair's channel is unusable afterwards (a checksum mismatch leaves it intact)."""
        return self is not TransferFailure.CHECKSUM


@dataclass(frozen=True, slots=True)
class Moved:
    """One transfer as one side saw it."""

    seconds: float
    checksum: int  # services/disagg/transfer/checksum.py of the bytes this side sent or received


# fill(rows), given to send, writes rows [start, stop) of the blocks' row view ([num_layers * 2, -1],
# services/disagg/transfer/chunks.py) just before the transport sends them: reading the cache overlaps the wire.
Fill = Callable[[slice], None]

# drain(rows), given to recv, takes rows [start, stop) of the buffer's row view once they have landed
# (and been hashed), in order, every row once, before recv returns: the receiver writes each chunk
# into its KV cache while the next one moves. A recv that fails stops calling it.
Drain = Callable[[slice], None]


class Backend(enum.Enum):
    """What moves a channel's bytes (torch_dist.py): the receiver picks it for the device its KV is
    on and names it in the channel; the sender follows."""

    GLOO = "gloo"  # TCP between host buffers (a CUDA tensor is staged through pinned memory)
    NCCL = "nccl"  # device to device; transfers on a channel move in the receiver's tag order


@dataclass(frozen=True, slots=True)
class ChannelSpec:
    """A receiver's channel to one sender, as the sender needs it to join."""

    address: str  # where to rendezvous: torch_dist: the receiver's TCPStore host:port
    key: str  # unique per channel incarnation; a dropped channel is never reused
    # Shared by the two ends of this channel only: sent inside the handoff RPC, never written to the
    # rendezvous store, never logged (hence repr=False).
    secret: bytes = field(repr=False)
    backend: Backend = Backend.GLOO


class TransferError(Exception):
    def __init__(self, reason: TransferFailure, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class KVReceiver(ABC):
    """Decode side: owns its channels and the transfers arriving on them."""

    @abstractmethod
    def channel_for(self, peer: str) -> ChannelSpec:
        """The live channel to peer (a prefill worker's address); a new one starts connecting in
        the background and is ready once the sender joins it."""

    @abstractmethod
    def next_tag(self, channel: ChannelSpec) -> int:
        """The channel's next tag: 1, 2, 3, ... on each channel (transports may reserve 0). The tag
        order is the receiver's order: an NCCL channel moves its transfers in it."""

    def use_device(self, device: torch.device) -> None:
        """Where this side's KV buffers live: channels named afterwards get the backend that suits it
        (a transport with one kind of channel ignores this)."""

    @abstractmethod
    async def recv(self, channel: ChannelSpec, tag: int, buffer: torch.Tensor, drain: Drain | None = None) -> Moved:
        """Fill buffer (contiguous) with the transfer sent under tag; returns the seconds it took and
        the checksum of what arrived. With drain, each range of rows goes to it as it lands."""

    @abstractmethod
    def drop(self, channel: ChannelSpec) -> None:
        """Forget a failed channel (no-op if already replaced)."""

    def close(self) -> None:
        """Release every channel."""


class KVSender(ABC):
    """Prefill side: joins the channels receivers name and sends on them."""

    @abstractmethod
    def connect(self, channel: ChannelSpec) -> None:
        """Start joining channel if new (non-blocking; call early so both sides meet sooner)."""

    def use_device(self, device: torch.device) -> None:
        """Where this side's KV lives: the device of the NCCL groups it joins (ignored otherwise)."""

    @abstractmethod
    async def send(self, channel: ChannelSpec, tag: int, blocks: torch.Tensor, fill: Fill | None = None) -> Moved:
        """Send blocks (contiguous) under tag; returns when the receiver has them, with the seconds and
        the checksum of what was sent. With fill, blocks is only a buffer the transport fills (every
        row, in order) as it goes; without, blocks are ready."""

    def close(self) -> None:
        """Release every channel."""
