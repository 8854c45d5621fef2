"""In-process transport for unit tests: sender and receiver share a Hub, from any threads (two
in-process engine cores, each running its handoffs on an event loop of its own).

Same contract as torch_dist (tags, timeouts, dropped channels, a secret per channel, checksums),
with tensors copied in memory.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hmac
import itertools
import secrets
import time
from collections.abc import Callable

import torch

from splitserve.services.disagg.transfer.base import (
    ChannelSpec,
    Drain,
    Fill,
    KVReceiver,
    KVSender,
    Moved,
    TransferError,
    TransferFailure,
)
from splitserve.services.disagg.transfer.checksum import checksum
from splitserve.services.disagg.transfer.chunks import row_view


class Hub:
    """The 'wire': transfers posted by senders, keyed by (channel key, tag)."""

    def __init__(self, timeout_s: float = 5.0) -> None:
        self.timeout_s = timeout_s
        self.slots: dict[tuple[str, int], concurrent.futures.Future[torch.Tensor]] = {}
        self.dead: set[str] = set()
        self.secrets: dict[str, bytes] = {}  # by channel key, as receivers made them
        self.tamper: Callable[[torch.Tensor], None] | None = None  # tests: changes the bytes in flight

    def check_secret(self, channel: ChannelSpec) -> None:
        """torch_dist's handshake, in memory: a sender without the channel's secret fails the channel
        for both sides with "auth", and nothing it sent reaches a receiver."""
        if hmac.compare_digest(self.secrets.get(channel.key, b""), channel.secret):
            return
        error = TransferError(TransferFailure.AUTH, f"the sender on channel {channel.key} has the wrong secret")
        self.dead.add(channel.key)
        for (key, _), slot in list(self.slots.items()):
            if key == channel.key:
                _settle(slot, error)
        raise error

    def slot(self, key: str, tag: int) -> concurrent.futures.Future[torch.Tensor]:
        if key in self.dead:
            raise TransferError(TransferFailure.CLOSED, f"channel {key} was closed after a failure")
        return self.slots.setdefault((key, tag), concurrent.futures.Future())


def _settle(slot: concurrent.futures.Future, outcome: torch.Tensor | BaseException) -> None:
    """The first outcome stays (a slot is settled from either side's thread)."""
    try:
        if isinstance(outcome, BaseException):
            slot.set_exception(outcome)
        else:
            slot.set_result(outcome)
    except concurrent.futures.InvalidStateError:
        pass


class InProcessReceiver(KVReceiver):
    def __init__(self, hub: Hub, name: str = "decode") -> None:
        self.hub, self.name = hub, name
        self._channels: dict[str, ChannelSpec] = {}
        self._ids = itertools.count()
        self._tags: dict[str, itertools.count] = {}  # by channel key

    def channel_for(self, peer: str) -> ChannelSpec:
        if peer not in self._channels:
            spec = ChannelSpec("inprocess", f"{self.name}->{peer}#{next(self._ids)}", secrets.token_bytes(32))
            self.hub.secrets[spec.key] = spec.secret
            self._channels[peer] = spec
        return self._channels[peer]

    def next_tag(self, channel: ChannelSpec) -> int:
        return next(self._tags.setdefault(channel.key, itertools.count(1)))

    async def recv(self, channel: ChannelSpec, tag: int, buffer: torch.Tensor, drain: Drain | None = None) -> Moved:
        start = time.monotonic()
        slot = self.hub.slot(channel.key, tag)
        try:
            data = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(slot)), self.hub.timeout_s)
        except TimeoutError:
            self.hub.dead.add(channel.key)
            message = f"no transfer {tag} on {channel.key} within {self.hub.timeout_s} s"
            raise TransferError(TransferFailure.TIMEOUT, message) from None
        finally:
            self.hub.slots.pop((channel.key, tag), None)
        buffer.copy_(data)
        crc = checksum(buffer)
        if drain is not None:
            drain(slice(0, row_view(buffer).shape[0]))
        return Moved(time.monotonic() - start, crc)

    def drop(self, channel: ChannelSpec) -> None:
        for peer, spec in list(self._channels.items()):
            if spec == channel:
                del self._channels[peer]
        self.hub.dead.add(channel.key)


class InProcessSender(KVSender):
    def __init__(self, hub: Hub) -> None:
        self.hub = hub

    def connect(self, channel: ChannelSpec) -> None:
        pass

    async def send(self, channel: ChannelSpec, tag: int, blocks: torch.Tensor, fill: Fill | None = None) -> Moved:
        start = time.monotonic()
        self.hub.check_secret(channel)
        slot = self.hub.slot(channel.key, tag)
        if fill is not None:  # off the event loop: a streamed fill waits for the layers it reads
            try:
                await asyncio.to_thread(fill, slice(0, row_view(blocks).shape[0]))
            except RuntimeError as e:  # as torch_dist: the sender drops the channel, the receiver fails
                error = TransferError(TransferFailure.PEER_LOST, f"the sender failed on {channel.key}: {e}")
                self.hub.dead.add(channel.key)
                _settle(slot, error)
                raise error from None
        crc = checksum(blocks)
        if not slot.done():
            wire = blocks.clone()
            if self.hub.tamper is not None:
                self.hub.tamper(wire)
            _settle(slot, wire)
        return Moved(time.monotonic() - start, crc)
