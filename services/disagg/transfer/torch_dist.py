"""torch.distributed transport: one two-rank process group per (decode, prefill) pair, no global
world, made at run time so workers of either tier can join and leave: gloo, plus NCCL when the
receiver's KV is on CUDA (the receiver picks, per channel: nccl.backend_for).

Rendezvous: every decode worker hosts a TCPStore for as long as it lives (so a store never
outlives the groups that need it). When a decode worker first hands a request to a prefill
worker it names a channel (its store address, a random key and a random secret) and starts
building its side of the group (rank 1) in the background; the handoff RPC carries the
ChannelSpec and the prefill worker builds rank 0 under the same key. Both constructors meet
through the store.

Handshake: the store has no authentication (anyone who reaches it can list the keys, join a
channel as rank 0, or rewrite the addresses the two ranks publish), so a new group carries no KV
until both ranks have shown they hold the channel's secret, which never enters the store:

    receiver -> sender, in-band (tag 0): a fresh 32-byte nonce
    sender   -> store "auth/sender":   HMAC(secret, "sender", key, nonce, rendezvous)
    receiver -> store "auth/receiver": HMAC(secret, "receiver", key, nonce, rendezvous), or b""
                                       when the sender's proof was wrong

`rendezvous` is what each rank published and read in the store while gloo built the group, so a
process that rewrote the addresses to sit between the two ranks (and relays the nonce) fails it.
Only the real sender can prove it received the nonce over the receiver's pair socket. Both sides
run the handshake inside the job that builds the group, so no KV send or recv is posted on a
group before it passes; a wrong proof shuts the group down and fails the channel with "auth".
The proofs go through the store rather than the pair because gloo aborts the whole process when
a peer sends more bytes than a posted receive holds: the receiver posts no receive at all before
its peer has proved itself (the sender's one 32-byte receive of the nonce is the exception).

Nothing on this wire is unpickled: KV and nonces travel as raw tensors (send/recv), the store
holds gloo's addresses and the proofs as bytes. Keep it that way: never send_object_list,
broadcast_object_list or any *_object collective (they unpickle what a peer sends).

Sockets: the store and gloo's pair sockets listen on the worker's advertised host only (for a
wildcard host the store listens on every interface and gloo on this machine's address). Each
channel has a gloo device of its own, so its listener lives with the channel: gloo's listener hands
a connection to whichever pair waits for the sequence number the connection names, and those
numbers count up from 0 per device, so on a listener every channel shared, connections planted
ahead by anyone would be taken by the next channels' pairs in place of their peers. gloo
neither encrypts nor authenticates its traffic after the handshake, and the store lets anyone
who reaches it read, write (any size) or delete keys: the workers must share a private network
(docs/security.md).

The store keeps a channel's keys only while the pair needs them: the receiver deletes both address
records and the sender's proof once it has that proof (the sender publishes it after its groups are
built, so nothing reads the addresses later), the sender deletes the receiver's proof once read, and
a dropped channel's prefix is swept once its build ends. gloo's address records are published
without the uninitialised bytes gloo copies into them (dist_store.scrub_address_record).

Groups are reused for every later transfer between the pair; concurrent transfers are told apart
by tag (>= 1; 0 is the handshake's). gloo closes a pair for good when a peer dies (a pending recv
raises at once) or an operation times out, so any failure drops the group on that side; the next
handoff names a new key and both sides build a fresh group. Every blocking wait runs in a worker
thread, bounded by the group timeout.

Wire: a gloo channel moves a transfer in chunks, each checksummed while the next moves (chunks.py;
a CUDA tensor is staged through pinned host memory on a side stream). An NCCL channel moves it
device to device, in the receiver's tag order (nccl.py, order.py; untested on a GPU so far).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import hmac
import itertools
import secrets
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TypeVar, cast

import torch
import torch.distributed as dist

from splitserve.common.bounded import RecentMap
from splitserve.common.dist_store import Device, gloo_device, host_store, scrub_address_record
from splitserve.services.disagg.transfer import nccl
from splitserve.services.disagg.transfer.base import (
    Backend,
    ChannelSpec,
    Drain,
    Fill,
    KVReceiver,
    KVSender,
    Moved,
    TransferError,
    TransferFailure,
)
from splitserve.services.disagg.transfer.chunks import recv_chunks, send_chunks
from splitserve.services.disagg.transfer.order import IssueOrder
from splitserve.services.engine.cpu_threads import serial_torch_ops
from splitserve.services.engine.model_runner import bind_thread

# Blocking gloo calls (group construction, whole transfers) run here; one thread per transfer in flight.
# Each job binds its thread to the worker's CUDA device first (_bound).
_EXECUTOR = ThreadPoolExecutor(max_workers=64, thread_name_prefix="kv-transfer", initializer=serial_torch_ops)
SENDER_RANK, RECEIVER_RANK = 0, 1
T = TypeVar("T")
AUTH_TAG = 0  # the handshake's nonce; KV transfers use tags from 1
NONCE_BYTES = SECRET_BYTES = 32
SENDER_PROOF, RECEIVER_PROOF = "auth/sender", "auth/receiver"  # store keys, under the channel's prefix


class _Rendezvous(dist.Store):
    """The store as gloo sees it while building one group: remembers the addresses this rank
    published (its own) and read (its peer's), which the handshake then binds. What gloo publishes
    goes out scrubbed of the process memory gloo copies into it (scrub_address_record)."""

    def __init__(self, store: dist.Store) -> None:
        super().__init__()
        self._store = store
        self._seen: dict[str, bytes] = {}

    def set(self, key: str, value: str | bytes) -> None:
        data = scrub_address_record(value.encode() if isinstance(value, str) else bytes(value))
        self._seen[key] = data
        _put(self._store, key, data)

    def get(self, key: str) -> bytes:
        value = self._store.get(key)
        self._seen.setdefault(key, bytes(value))  # for its own key, a rank keeps what it published
        return value

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._store.wait(keys) if timeout is None else self._store.wait(keys, timeout)

    def add(self, key: str, amount: int) -> int:
        return self._store.add(key, amount)

    def check(self, keys: list[str]) -> bool:
        return self._store.check(keys)

    def digest(self) -> bytes:
        return b"".join(hashlib.sha256(k.encode() + b"=" + v).digest() for k, v in sorted(self._seen.items()))

    def keys(self) -> list[str]:
        """Every key this rank published or read."""
        return list(self._seen)


def _forget(store: dist.Store, keys: list[str]) -> None:
    """Delete keys from the store: readable by anyone who reaches it, held in the decode worker's memory."""
    for key in keys:
        store.delete_key(key)


def sweep_channel(store: dist.Store, key: str) -> None:
    """Delete whatever a channel left in the store (its own keys and anything written under its prefix)."""
    prefix = f"kv/{key}/"
    _forget(store, [name for name in store.list_keys() if name.startswith(prefix)])


def _put(store: dist.Store, key: str, value: bytes) -> None:
    store.set(key, value)  # type: ignore[arg-type]  # bytes are fine; torch's stub says str only


@dataclass(eq=False, slots=True)
class _Link:
    """A channel's groups, once built."""

    gloo: dist.ProcessGroup  # the handshake's, and a gloo channel's KV
    nccl: dist.ProcessGroup | None = None  # an NCCL channel's KV
    cuda: torch.device | None = None  # the NCCL group's device
    order: IssueOrder = field(default_factory=IssueOrder)  # an NCCL channel's: the receiver's tag order

    def shutdown(self) -> None:
        self.order.break_order()
        for group in (self.nccl, self.gloo):
            if group is not None:
                group.shutdown()


def _open(
    store: dist.Store, channel: ChannelSpec, rank: int, device: Device, cuda: torch.device | None, timeout_s: float
) -> tuple[_Link, _Rendezvous]:
    """The pair's groups (for an NCCL channel, its NCCL group too, connected in the same
    rendezvous), with the rendezvous this rank saw."""
    # torch's stubs lag its bindings here (no _Options, no send/recv on ProcessGroupGloo): hence
    # the ignore and the cast.
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    options._devices = [device]
    options._timeout = timedelta(seconds=timeout_s)
    rendezvous = _Rendezvous(store)
    link = _Link(cast(dist.ProcessGroup, dist.ProcessGroupGloo(rendezvous, rank, 2, options)))
    if channel.backend is Backend.NCCL:
        link.cuda = cuda or torch.device("cuda", torch.cuda.current_device())
        try:
            link.nccl = nccl.make_group(rendezvous, rank, link.cuda, timeout_s)
        except BaseException:  # release the gloo group's sockets, whatever went wrong
            link.shutdown()
            raise
    return link, rendezvous


def _proof(channel: ChannelSpec, role: bytes, nonce: bytes, rendezvous: bytes) -> bytes:
    mac = hmac.new(channel.secret, digestmod=hashlib.sha256)
    for part in (role, channel.key.encode(), nonce, rendezvous):
        mac.update(len(part).to_bytes(8, "big") + part)
    return mac.digest()


def _await_proof(store: dist.Store, key: str, timeout_s: float) -> bytes:
    store.wait([key], timedelta(seconds=timeout_s))
    return store.get(key)


def _refused(link: _Link, channel: ChannelSpec, who: str) -> TransferError:
    link.shutdown()
    message = (
        f"the {who} on KV channel {channel.key} could not prove it holds the channel's secret; another "
        f"process reached the TCPStore at {channel.address} (keep workers on a private network)"
    )
    return TransferError(TransferFailure.AUTH, message)


def _accept_channel(
    store: dist.Store, channel: ChannelSpec, host: str, cuda: torch.device | None, timeout_s: float
) -> _Link:
    """Receiver side of a new channel: build the group and admit the peer only once it has proved
    itself (module docstring)."""
    scoped = dist.PrefixStore(f"kv/{channel.key}", store)
    link, seen = _open(scoped, channel, RECEIVER_RANK, gloo_device(host), cuda, timeout_s)
    rendezvous, nonce = seen.digest(), secrets.token_bytes(NONCE_BYTES)
    try:
        link.gloo.send([torch.frombuffer(bytearray(nonce), dtype=torch.uint8)], SENDER_RANK, AUTH_TAG).wait()
        admitted = hmac.compare_digest(
            _await_proof(scoped, SENDER_PROOF, timeout_s), _proof(channel, b"sender", nonce, rendezvous)
        )
        _put(scoped, RECEIVER_PROOF, _proof(channel, b"receiver", nonce, rendezvous) if admitted else b"")
        # The sender published its proof once its groups were built: the addresses are read. The
        # receiver's proof is the sender's to delete once read (a channel dropped first is swept).
        _forget(scoped, [*seen.keys(), SENDER_PROOF])
    except RuntimeError:  # gloo or the store failed or timed out: the channel never opened
        link.shutdown()
        raise
    if not admitted:
        raise _refused(link, channel, "prefill worker")
    return link


def _join_channel(
    store: dist.Store, channel: ChannelSpec, host: str, cuda: torch.device | None, timeout_s: float
) -> _Link:
    """Sender side of a new channel: answer the receiver's nonce; send KV only once the receiver
    has proved itself too."""
    scoped = dist.PrefixStore(f"kv/{channel.key}", store)
    link, seen = _open(scoped, channel, SENDER_RANK, gloo_device(host), cuda, timeout_s)
    rendezvous, received = seen.digest(), torch.empty(NONCE_BYTES, dtype=torch.uint8)
    try:
        link.gloo.recv([received], RECEIVER_RANK, AUTH_TAG).wait()
        nonce = received.numpy().tobytes()
        _put(scoped, SENDER_PROOF, _proof(channel, b"sender", nonce, rendezvous))
        proof = _await_proof(scoped, RECEIVER_PROOF, timeout_s)
        _forget(scoped, [RECEIVER_PROOF])
    except RuntimeError:
        link.shutdown()
        raise
    if not hmac.compare_digest(proof, _proof(channel, b"receiver", nonce, rendezvous)):
        raise _refused(link, channel, "decode worker")
    return link


def _check_tag(tag: int) -> None:
    if tag <= AUTH_TAG:
        raise ValueError(f"KV transfer tags start at {AUTH_TAG + 1} (tag {AUTH_TAG} is the handshake's), got {tag}")


def _reason(error: Exception) -> TransferFailure:
    # Gloo reports both as RuntimeError (DistBackendError); only its message tells them apart.
    timed_out = "Timed out" in str(error) or "timeout" in str(error).lower()
    return TransferFailure.TIMEOUT if timed_out else TransferFailure.PEER_LOST


def _recv_gloo(link: _Link, tag: int, buffer: torch.Tensor, drain: Drain | None, timeout_s: float) -> int:
    return recv_chunks(link.gloo, SENDER_RANK, tag, buffer, drain)


def _recv_nccl(link: _Link, tag: int, buffer: torch.Tensor, drain: Drain | None, timeout_s: float) -> int:
    assert link.nccl is not None and link.cuda is not None
    return nccl.recv(link.nccl, link.order, SENDER_RANK, tag, buffer, link.cuda, timeout_s, drain)


def _send_gloo(link: _Link, tag: int, blocks: torch.Tensor, fill: Fill | None, timeout_s: float) -> int:
    return send_chunks(link.gloo, RECEIVER_RANK, tag, blocks, fill)


def _send_nccl(link: _Link, tag: int, blocks: torch.Tensor, fill: Fill | None, timeout_s: float) -> int:
    assert link.nccl is not None and link.cuda is not None
    return nccl.send(link.nccl, link.order, RECEIVER_RANK, tag, blocks, fill, link.cuda, timeout_s)


# How each backend moves a whole transfer (every chunk, its checksum), on one worker thread.
_RECEIVE: dict[Backend, Callable[[_Link, int, torch.Tensor, Drain | None, float], int]] = {
    Backend.GLOO: _recv_gloo,
    Backend.NCCL: _recv_nccl,
}
_SEND: dict[Backend, Callable[[_Link, int, torch.Tensor, Fill | None, float], int]] = {
    Backend.GLOO: _send_gloo,
    Backend.NCCL: _send_nccl,
}


async def _run(cuda: torch.device | None, move: Callable[..., int], *args) -> int:
    return await asyncio.get_running_loop().run_in_executor(_EXECUTOR, _bound, cuda, move, *args)


def _bound(cuda: torch.device | None, job: Callable[..., T], *args) -> T:
    """job(*args) on this executor thread, bound to cuda first (where pinned staging, side streams
    and NCCL communicators made in it belong; unbound, a pool thread's current device is 0)."""
    if cuda is not None:
        bind_thread(cuda)
    return job(*args)


async def _link(future: Future) -> _Link:
    """The channel's groups once built (no thread hop when they already are)."""
    return future.result() if future.done() else await asyncio.wrap_future(future)


def new_channel(address: str, backend: Backend = Backend.GLOO) -> ChannelSpec:
    """A fresh channel at the store at address: the key is unguessable too, but only the secret (never
    in the store) is relied on."""
    return ChannelSpec(address, secrets.token_hex(16), secrets.token_bytes(SECRET_BYTES), backend)


class TorchDistReceiver(KVReceiver):
    """Decode side. Hosts the TCPStore every channel of this worker meets through."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        timeout_s: float = 30.0,
        device: torch.device | None = None,
        listener: socket.socket | None = None,
    ) -> None:
        """listener: a socket already listening on host for the store (a KV agent's: agent.py), which
        the store takes over; else it listens on a free port of its own."""
        self.timeout_s = timeout_s
        self.store = host_store(host, timeout_s, listener)
        self.address = f"{host}:{self.store.port}"
        self._host = host  # where each channel's gloo device listens
        self.backend: Backend = Backend.GLOO  # of the channels named from now on
        self._cuda: torch.device | None = None
        if device is not None:
            self.use_device(device)
        self._tags: dict[str, itertools.count] = {}  # by channel key
        self._channels: dict[str, tuple[ChannelSpec, Future]] = {}  # by peer

    def use_device(self, device: torch.device) -> None:
        self.backend, self._cuda = nccl.backend_for(device), device if device.type == "cuda" else None

    def channel_for(self, peer: str) -> ChannelSpec:
        entry = self._channels.get(peer)
        if entry is None:
            spec = new_channel(self.address, self.backend)
            self.accept(peer, spec)
            return spec
        return entry[0]

    def accept(self, peer: str, spec: ChannelSpec) -> None:
        """Start building spec's group, as peer's channel (named by this receiver's KV agent's owner:
        isolated.py; channel_for names its own)."""
        store, cuda, timeout_s = self.store, self._cuda, self.timeout_s
        future = _EXECUTOR.submit(_bound, cuda, _accept_channel, store, spec, self._host, cuda, timeout_s)
        self._channels[peer] = (spec, future)

    def next_tag(self, channel: ChannelSpec) -> int:
        return next(self._tags.setdefault(channel.key, itertools.count(AUTH_TAG + 1)))

    def _group_future(self, channel: ChannelSpec) -> Future:
        for spec, future in self._channels.values():
            if spec == channel:
                return future
        raise TransferError(TransferFailure.CLOSED, f"channel {channel.key} was dropped after a failure")

    async def recv(self, channel: ChannelSpec, tag: int, buffer: torch.Tensor, drain: Drain | None = None) -> Moved:
        _check_tag(tag)
        start = time.monotonic()
        try:
            link = await _link(self._group_future(channel))
        except TransferError:
            raise
        except Exception as e:
            message = f"the prefill worker never joined channel {channel.key}: {e}"
            raise TransferError(TransferFailure.CONNECT, message) from None
        try:
            crc = await _run(self._cuda, _RECEIVE[channel.backend], link, tag, buffer, drain, self.timeout_s)
        except RuntimeError as e:
            raise TransferError(_reason(e), f"receiving KV on channel {channel.key} failed: {e}") from None
        return Moved(time.monotonic() - start, crc)

    def drop(self, channel: ChannelSpec) -> None:
        for peer, (spec, future) in list(self._channels.items()):
            if spec == channel:
                del self._channels[peer]
                self._tags.pop(spec.key, None)
                future.add_done_callback(_shutdown_link)
                # Once its build is over (built, refused or timed out), so it never races gloo's reads.
                future.add_done_callback(functools.partial(self._sweep, spec.key))

    def _sweep(self, key: str, _: Future) -> None:
        sweep_channel(self.store, key)

    def close(self) -> None:
        for spec, _ in list(self._channels.values()):
            self.drop(spec)


class TorchDistSender(KVSender):
    """Prefill side. Keeps one live group per receiver (a new key from it replaces the old)."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        timeout_s: float = 30.0,
        device: torch.device | None = None,
        max_failed_channels: int = 4096,
    ) -> None:
        self.timeout_s = timeout_s
        self._host = host  # where each channel's gloo device listens
        self._cuda: torch.device | None = None  # for NCCL channels
        if device is not None:
            self.use_device(device)
        self._lock = threading.Lock()  # guards _stores (filled from executor threads)
        self._stores: dict[str, dist.TCPStore] = {}
        self._groups: dict[str, tuple[str, Future]] = {}  # receiver address -> (key, group)
        # keys of failed channels, refused as closed; bounded: receivers make a new key per channel
        self._dead: RecentMap[str, bool] = RecentMap(max_failed_channels)

    def connect(self, channel: ChannelSpec) -> None:
        if channel.key in self._dead:
            return
        current = self._groups.get(channel.address)
        if current is not None and current[0] == channel.key:
            return
        if current is not None:  # the receiver replaced the channel: its old group is gone
            current[1].add_done_callback(_shutdown_link)
        future = _EXECUTOR.submit(_bound, self._cuda, self._join, channel)
        self._groups[channel.address] = (channel.key, future)

    def use_device(self, device: torch.device) -> None:
        self._cuda = device if device.type == "cuda" else None

    def _join(self, channel: ChannelSpec) -> _Link:
        with self._lock:
            store = self._stores.get(channel.address)
        if store is not None:
            try:
                return _join_channel(store, channel, self._host, self._cuda, self.timeout_s)
            except dist.DistNetworkError:  # that store is gone (a new one may listen there: a KV agent's)
                with self._lock:
                    self._stores.pop(channel.address, None)
        host, port = channel.address.rsplit(":", 1)
        store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=self.timeout_s))
        with self._lock:
            self._stores[channel.address] = store
        return _join_channel(store, channel, self._host, self._cuda, self.timeout_s)

    async def send(self, channel: ChannelSpec, tag: int, blocks: torch.Tensor, fill: Fill | None = None) -> Moved:
        _check_tag(tag)
        start = time.monotonic()
        if channel.key in self._dead:
            raise TransferError(TransferFailure.CLOSED, f"channel {channel.key} was closed after a failure; reconnect")
        self.connect(channel)
        key, future = self._groups[channel.address]
        if key != channel.key:
            raise TransferError(TransferFailure.CLOSED, f"channel {channel.key} was replaced by {key}")
        try:
            # shielded: a cancelled send stops waiting, the join goes on for the channel's later transfers
            link = await asyncio.shield(_link(future))
        except TransferError:
            self._fail(channel)
            raise
        except Exception as e:
            self._fail(channel)
            with self._lock:  # the store may be gone with its decode worker: reconnect next time
                self._stores.pop(channel.address, None)
            message = f"could not join channel {channel.key} at {channel.address}: {e}"
            raise TransferError(TransferFailure.CONNECT, message) from None
        moving = asyncio.ensure_future(
            _run(self._cuda, _SEND[channel.backend], link, tag, blocks, fill, self.timeout_s)
        )
        try:
            crc = await asyncio.shield(moving)
        except asyncio.CancelledError:  # gloo reads blocks until the transfer ends: the cancel waits for it
            await asyncio.wait({moving})
            if moving.exception() is not None:
                self._fail(channel)
            raise
        except TransferError:
            self._fail(channel)
            raise
        except RuntimeError as e:
            self._fail(channel)
            raise TransferError(_reason(e), f"sending KV on channel {channel.key} failed: {e}") from None
        return Moved(time.monotonic() - start, crc)

    def _fail(self, channel: ChannelSpec) -> None:
        self._dead.set(channel.key, True)
        current = self._groups.get(channel.address)
        if current is not None and current[0] == channel.key:
            del self._groups[channel.address]
            current[1].add_done_callback(_shutdown_link)

    def close(self) -> None:
        for _, future in self._groups.values():
            future.add_done_callback(_shutdown_link)
        self._groups.clear()


def _shutdown_link(future: Future) -> None:
    """Release a dropped channel's groups once they exist (they may still be connecting)."""
    if future.cancelled() or future.exception() is not None:
        return
    try:
        future.result().shutdown()
    except Exception:  # already broken: nothing left to release
        pass
