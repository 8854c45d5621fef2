"""torch.distributed transport: one two-rank gloo process group per (decode, prefill) pair, no
global world, made at run time so workers of either tier can join and leave.

Rendezvous: every decode worker hosts a TCPStore for as long as it lives (so a store never
outlives the groups that need it). When a decode worker first hands a request to a prefill
worker it names a channel (its store address + a key never used before) and starts building its
side of the group (rank 1) in the background; the handoff RPC carries the ChannelSpec and the
prefill worker builds rank 0 under the same key. Both constructors meet through the store.

Groups are reused for every later transfer between the pair; concurrent transfers are told apart
by tag. gloo closes a pair for good when a peer dies (a pending recv raises at once) or an
operation times out, so any failure drops the group on that side; the next handoff names a new
key and both sides build a fresh group. Every blocking wait runs in a worker thread, bounded by
the group timeout.

GPU: blocks are staged through host memory and moved by gloo. NCCL pair groups are not used yet:
NCCL point-to-point ignores tags, so concurrent transfers on one pair would need an agreed order.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta

import torch
import torch.distributed as dist

from splitserve.disagg.transfer.base import ChannelSpec, KVReceiver, KVSender, TransferError, TransferFailure

# Blocking gloo calls (group construction, work.wait) run here; one thread per transfer in flight.
_EXECUTOR = ThreadPoolExecutor(max_workers=64, thread_name_prefix="kv-transfer")
SENDER_RANK, RECEIVER_RANK = 0, 1


def _make_group(store: dist.Store, key: str, rank: int, timeout_s: float) -> dist.ProcessGroupGloo:
    return dist.ProcessGroupGloo(dist.PrefixStore(f"kv/{key}", store), rank, 2, timedelta(seconds=timeout_s))


def _reason(error: Exception) -> TransferFailure:
    # Gloo reports both as RuntimeError (DistBackendError); only its message tells them apart.
    timed_out = "Timed out" in str(error) or "timeout" in str(error).lower()
    return TransferFailure.TIMEOUT if timed_out else TransferFailure.PEER_LOST


async def _wait(work) -> None:
    await asyncio.get_running_loop().run_in_executor(_EXECUTOR, work.wait)


async def _group(future: Future) -> dist.ProcessGroup:
    """The group once built (no thread hop when it already is)."""
    return future.result() if future.done() else await asyncio.wrap_future(future)


class TorchDistReceiver(KVReceiver):
    """Decode side. Hosts the TCPStore every channel of this worker meets through."""

    def __init__(self, host: str = "127.0.0.1", timeout_s: float = 30.0) -> None:
        self.timeout_s = timeout_s
        self.store = dist.TCPStore(
            host, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s)
        )
        self.address = f"{host}:{self.store.port}"
        self._prefix = uuid.uuid4().hex[:8]  # keys stay unique across restarts on the same port
        self._ids = itertools.count()
        self._tags = itertools.count(1)
        self._channels: dict[str, tuple[ChannelSpec, Future]] = {}  # by peer

    def channel_for(self, peer: str) -> ChannelSpec:
        entry = self._channels.get(peer)
        if entry is None:
            spec = ChannelSpec(self.address, f"{self._prefix}-{next(self._ids)}")
            future = _EXECUTOR.submit(_make_group, self.store, spec.key, RECEIVER_RANK, self.timeout_s)
            entry = self._channels[peer] = (spec, future)
        return entry[0]

    def next_tag(self, channel: ChannelSpec) -> int:
        return next(self._tags)

    def _group_future(self, channel: ChannelSpec) -> Future:
        for spec, future in self._channels.values():
            if spec == channel:
                return future
        raise TransferError(TransferFailure.CLOSED, f"channel {channel.key} was dropped after a failure")

    async def recv(self, channel: ChannelSpec, tag: int, buffer: torch.Tensor) -> float:
        start = time.monotonic()
        try:
            group = await _group(self._group_future(channel))
        except TransferError:
            raise
        except Exception as e:
            message = f"the prefill worker never joined channel {channel.key}: {e}"
            raise TransferError(TransferFailure.CONNECT, message) from None
        staged = buffer if buffer.device.type == "cpu" else torch.empty_like(buffer, device="cpu")
        try:
            await _wait(group.recv([staged], SENDER_RANK, tag))
        except RuntimeError as e:
            raise TransferError(_reason(e), f"receiving KV on channel {channel.key} failed: {e}") from None
        if staged is not buffer:
            buffer.copy_(staged)
        return time.monotonic() - start

    def drop(self, channel: ChannelSpec) -> None:
        for peer, (spec, future) in list(self._channels.items()):
            if spec == channel:
                del self._channels[peer]
                future.add_done_callback(_shutdown_group)

    def close(self) -> None:
        for spec, _ in list(self._channels.values()):
            self.drop(spec)


class TorchDistSender(KVSender):
    """Prefill side. Keeps one live group per receiver (a new key from it replaces the old)."""

    def __init__(self, timeout_s: float = 30.0) -> None:
        self.timeout_s = timeout_s
        self._lock = threading.Lock()  # guards _stores (filled from executor threads)
        self._stores: dict[str, dist.TCPStore] = {}
        self._groups: dict[str, tuple[str, Future]] = {}  # receiver address -> (key, group)
        self._dead: set[str] = set()

    def connect(self, channel: ChannelSpec) -> None:
        if channel.key in self._dead:
            return
        current = self._groups.get(channel.address)
        if current is not None and current[0] == channel.key:
            return
        if current is not None:  # the receiver replaced the channel: its old group is gone
            current[1].add_done_callback(_shutdown_group)
        future = _EXECUTOR.submit(self._join, channel)
        self._groups[channel.address] = (channel.key, future)

    def _join(self, channel: ChannelSpec) -> dist.ProcessGroupGloo:
        with self._lock:
            store = self._stores.get(channel.address)
        if store is None:
            host, port = channel.address.rsplit(":", 1)
            store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=self.timeout_s))
            with self._lock:
                self._stores[channel.address] = store
        return _make_group(store, channel.key, SENDER_RANK, self.timeout_s)

    async def send(self, channel: ChannelSpec, tag: int, blocks: torch.Tensor) -> float:
        start = time.monotonic()
        if channel.key in self._dead:
            raise TransferError(TransferFailure.CLOSED, f"channel {channel.key} was closed after a failure; reconnect")
        self.connect(channel)
        key, future = self._groups[channel.address]
        if key != channel.key:
            raise TransferError(TransferFailure.CLOSED, f"channel {channel.key} was replaced by {key}")
        try:
            group = await _group(future)
        except Exception as e:
            self._fail(channel)
            with self._lock:  # the store may be gone with its decode worker: reconnect next time
                self._stores.pop(channel.address, None)
            message = f"could not join channel {channel.key} at {channel.address}: {e}"
            raise TransferError(TransferFailure.CONNECT, message) from None
        staged = blocks.contiguous() if blocks.device.type == "cpu" else blocks.cpu()
        try:
            await _wait(group.send([staged], RECEIVER_RANK, tag))
        except RuntimeError as e:
            self._fail(channel)
            raise TransferError(_reason(e), f"sending KV on channel {channel.key} failed: {e}") from None
        return time.monotonic() - start

    def _fail(self, channel: ChannelSpec) -> None:
        self._dead.add(channel.key)
        current = self._groups.get(channel.address)
        if current is not None and current[0] == channel.key:
            del self._groups[channel.address]
            current[1].add_done_callback(_shutdown_group)

    def close(self) -> None:
        for _, future in self._groups.values():
            future.add_done_callback(_shutdown_group)
        self._groups.clear()


def _shutdown_group(future: Future) -> None:
    """Release a dropped group's sockets once it exists (it may still be connecting)."""
    if future.cancelled() or future.exception() is not None:
        return
    try:
        future.result().shutdown()
    except Exception:  # already broken: nothing left to release
        pass
