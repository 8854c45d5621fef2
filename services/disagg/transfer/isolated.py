"""The KV transport workers use: torch_dist's, run in a KV agent process (agent.py) so that an abort in
gloo or a store filled by another local user fails transfers, never the worker.

AgentReceiver and AgentSender keep the KVReceiver/KVSender contract. A transfer's tensor goes
through a memfd segment both processes map (kept for the next transfer of its size): the receiver
copies each chunk from it into the caller's buffer (then drain) as the agent reports it landed; the
sender fills each chunk (fill, then a copy into the segment) when the agent asks for it. The copies
run on a helper thread while the next chunk is on the wire.

When the agent dies, every transfer on it fails with peer_lost and a new agent starts at once (after
a pause of RESTART_PAUSE_S if the last one lived less than that): a receiver names new channels on
it, at the same store address (the worker keeps the store's listening socket); a sender refuses the
channels it had joined on the dead one as closed, so the receiver names new ones. The decode worker
recomputes the prompts whose KV did not arrive, as for any failed transfer.

Only gloo channels: the agent cannot reach the worker's CUDA memory or NCCL. make_receiver and
make_sender give a worker whose KV is on CUDA torch_dist's transport in its own process (NCCL
channels), which leaves gloo's listener in the worker (docs/security.md says what that means on a
shared host).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from splitserve.common.bounded import RecentMap
from splitserve.common.dist_store import listen
from splitserve.protos.v1 import kv_agent_pb2 as apb
from splitserve.services.disagg.transfer.agent import MAX_PACKET_BYTES, channel_to_proto, map_segment, tensor_to_proto
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
from splitserve.services.disagg.transfer.chunks import row_view
from splitserve.services.disagg.transfer.torch_dist import AUTH_TAG, TorchDistReceiver, TorchDistSender, new_channel
from splitserve.services.engine.cpu_threads import serial_torch_ops

log = logging.getLogger("splitserve.kv_agent")
# What an agent may allocate beyond what it holds once started: its transfers need little (their
# tensors are segments, not heap); anything written into its store past this ends the agent.
AGENT_DATA_BYTES = 256 << 20
RESTART_PAUSE_S = 1.0
IDLE_SEGMENT_BYTES = 512 << 20  # shared memory a worker keeps mapped between transfers
AGENT_START_TIMEOUT_S = 120.0  # an agent imports torch: seconds on a loaded machine
# The copies between segments and the caller's tensors; serial, as chunks.py's helpers.
_COPIES = ThreadPoolExecutor(max_workers=16, thread_name_prefix="kv-agent-copies", initializer=serial_torch_ops)


@dataclass(eq=False)
class _Call:
    """One transfer's events from the agent, on the caller's loop; None once the agent is gone."""

    generation: int
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue[apb.AgentEvent | None] = field(default_factory=asyncio.Queue)

    def deliver(self, event: apb.AgentEvent | None) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the caller's loop is closed: nobody waits
            pass


@dataclass(eq=False)
class _Incarnation:
    """One agent process and the worker's end of its socketpair."""

    generation: int
    process: subprocess.Popen
    sock: socket.socket
    started: float = field(default_factory=time.monotonic)
    ready: threading.Event = field(default_factory=threading.Event)


class KVAgent:
    """A worker's KV agent (one role), restarted whenever it dies; sends its commands (queued while
    it starts) and routes its events to the calls waiting for them."""

    def __init__(self, role: str, host: str, timeout_s: float, listener: socket.socket | None = None) -> None:
        self.role, self.host, self.timeout_s, self._listener = role, host, timeout_s, listener
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._calls: dict[int, _Call] = {}
        self._outbox: list[tuple[bytes, int | None]] = []  # for the agent starting (its fds dup'd)
        self._closing = threading.Event()
        self.generation = 0  # of the agent commands go to now; one more each time one dies
        self._current: _Incarnation | None = self._spawn()

    # -- commands -----------------------------------------------------------------------------------
    def command(self, command: apb.AgentCommand, fd: int | None = None) -> int:
        """Send command (fd beside it) to the agent; returns its generation."""
        data = command.SerializeToString()
        with self._lock:
            current = self._current
            if current is None or not current.ready.is_set():
                self._outbox.append((data, None if fd is None else os.dup(fd)))
            else:
                _send(current.sock, data, fd)
            return self.generation

    def call(self, command: apb.AgentCommand, fd: int | None = None) -> tuple[int, _Call]:
        """Start a call (its id set here); its events come to the returned call on this loop."""
        call_id = command.call_id = next(self._ids)
        with self._lock:
            call = self._calls[call_id] = _Call(self.generation, asyncio.get_running_loop())
        self.command(command, fd)
        return call_id, call

    def end(self, call_id: int) -> None:
        with self._lock:
            self._calls.pop(call_id, None)

    def pid(self) -> int | None:
        """The running agent's process id (None while one starts)."""
        current = self._current
        return None if current is None else current.process.pid

    def wait_ready(self, timeout_s: float) -> int:
        """The pid of the running agent once it has said it is ready (TimeoutError after timeout_s)."""
        deadline = time.monotonic() + timeout_s
        while (current := self._current) is None or not current.ready.wait(max(0.0, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                raise TimeoutError(f"the KV {self.role} agent was not ready within {timeout_s} s")
            self._closing.wait(0.05)  # between a death and the next agent's start
        return current.process.pid

    def close(self) -> None:
        self._closing.set()
        with self._lock:
            current, self._current = self._current, None
        if current is not None:
            _stop(current)

    # -- the agent's life (its reader thread) -------------------------------------------------------
    def _spawn(self) -> _Incarnation:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        store_fd = -1 if self._listener is None else self._listener.fileno()
        argv = [self.role, self.host, str(self.timeout_s), str(theirs.fileno()), str(store_fd), str(AGENT_DATA_BYTES)]
        fds = [theirs.fileno()] + ([] if store_fd < 0 else [store_fd])
        try:
            module = "splitserve.services.disagg.transfer.agent"
            process = subprocess.Popen([sys.executable, "-m", module, *argv], pass_fds=fds, stdin=subprocess.DEVNULL)
        finally:
            theirs.close()
        incarnation = _Incarnation(self.generation, process, ours)
        threading.Thread(target=self._watch, args=(incarnation,), name="kv-agent-events", daemon=True).start()
        return incarnation

    def _watch(self, incarnation: _Incarnation) -> None:
        while data := _read(incarnation.sock):
            event = apb.AgentEvent.FromString(data)
            if event.HasField("ready"):
                self._ready(incarnation)
                continue
            with self._lock:
                call = self._calls.get(event.call_id)
            if call is not None:
                call.deliver(event)
        self._lost(incarnation)

    def _ready(self, incarnation: _Incarnation) -> None:
        with self._lock:
            incarnation.ready.set()
            outbox, self._outbox = self._outbox, []
            for data, fd in outbox:
                _send(incarnation.sock, data, fd)
                if fd is not None:
                    os.close(fd)

    def _lost(self, incarnation: _Incarnation) -> None:
        """The agent is gone: fail its calls; start the next one (unless closing)."""
        code = _stop(incarnation)
        with self._lock:
            lost = [c for c in self._calls.values() if c.generation == incarnation.generation]
            if self._current is incarnation:
                self._current = None
                self.generation += 1
        for call in lost:
            call.deliver(None)
        if self._closing.is_set():
            return
        log.warning(
            "the KV %s agent (pid %d) exited with code %s; its %d transfers fail; starting a new one",
            self.role,
            incarnation.process.pid,
            code,
            len(lost),
        )
        if time.monotonic() - incarnation.started < RESTART_PAUSE_S and self._closing.wait(RESTART_PAUSE_S):
            return
        with self._lock:
            if self._closing.is_set():
                return
            self._current = self._spawn()


def _send(sock: socket.socket, data: bytes, fd: int | None) -> None:
    try:
        if fd is None:
            sock.send(data)
        else:
            socket.send_fds(sock, [data], [fd])
    except OSError:  # the agent died: its reader sees the end and fails the calls
        pass


def _read(sock: socket.socket) -> bytes:
    try:
        return sock.recv(MAX_PACKET_BYTES)
    except OSError:
        return b""


def _stop(incarnation: _Incarnation) -> int | None:
    """End the agent (it exits once its socket closes) and reap it; its exit code."""
    try:
        incarnation.sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    try:
        return incarnation.process.wait(timeout=5)
    except subprocess.TimeoutExpired:
        incarnation.process.kill()
        return incarnation.process.wait()


class _Segment:
    """Shared memory (a memfd) for transfers of one size, mapped here; the agent maps its descriptor
    for each transfer."""

    def __init__(self, num_bytes: int) -> None:
        self.fd = os.memfd_create("splitserve-kv", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, num_bytes)
        self.num_bytes = num_bytes
        self.flat = map_segment(self.fd, apb.AgentTensor(shape=[num_bytes], dtype="uint8"))

    def view(self, like: torch.Tensor) -> torch.Tensor:
        return self.flat.view(like.dtype).view(like.shape)

    def close(self) -> None:
        os.close(self.fd)


class _Segments:
    """Segments kept for reuse, by size: a fresh segment's pages cost a zero-filled page fault each,
    on both sides (~0.3-0.5 ms per MB on this project's CPU machine), every transfer. A segment comes
    back only once its agent has ended the call (a cancelled send's agent may still read it)."""

    def __init__(self, max_idle_bytes: int) -> None:
        self.max_idle_bytes = max_idle_bytes
        self._lock = threading.Lock()
        self._idle: dict[int, list[_Segment]] = {}
        self._idle_bytes = 0

    def take(self, like: torch.Tensor) -> _Segment:
        num_bytes = like.numel() * like.element_size()
        with self._lock:
            idle = self._idle.get(num_bytes)
            if idle:
                self._idle_bytes -= num_bytes
                return idle.pop()
        return _Segment(num_bytes)

    def give(self, segment: _Segment) -> None:
        with self._lock:
            if self._idle_bytes + segment.num_bytes <= self.max_idle_bytes:
                self._idle.setdefault(segment.num_bytes, []).append(segment)
                self._idle_bytes += segment.num_bytes
                return
        segment.close()


_SEGMENTS = _Segments(IDLE_SEGMENT_BYTES)


def _failure(event: apb.AgentEvent | None, role: str, channel: ChannelSpec) -> TransferError:
    if event is None:
        return TransferError(TransferFailure.PEER_LOST, f"the KV {role} agent died during a transfer on {channel.key}")
    return TransferError(TransferFailure(event.failed.reason), event.failed.message)


def _check_tag(tag: int) -> None:
    if tag <= AUTH_TAG:
        raise ValueError(f"KV transfer tags start at {AUTH_TAG + 1} (tag {AUTH_TAG} is the handshake's), got {tag}")


async def _copy(job, *args) -> None:
    """job(*args) on a copy thread; a cancel waits for it (it writes the caller's tensors, which the
    caller releases once the cancel reaches it)."""
    copying = asyncio.get_running_loop().run_in_executor(_COPIES, job, *args)
    try:
        await asyncio.shield(copying)
    except asyncio.CancelledError:
        await asyncio.wait({copying})
        raise


class AgentReceiver(KVReceiver):
    """Decode side: its TCPStore and gloo in a KV agent; the store's address lasts as long as this."""

    def __init__(self, host: str = "127.0.0.1", timeout_s: float = 30.0, device: torch.device | None = None) -> None:
        self.timeout_s = timeout_s
        self._listener = listen(host)
        self.address = f"{host}:{self._listener.getsockname()[1]}"
        self.agent = KVAgent("receiver", host, timeout_s, self._listener)
        self._channels: dict[str, tuple[ChannelSpec, int]] = {}  # by peer: (channel, its agent's generation)
        self._tags: dict[str, itertools.count] = {}  # by channel key

    def channel_for(self, peer: str) -> ChannelSpec:
        entry = self._channels.get(peer)
        if entry is not None and entry[1] == self.agent.generation:
            return entry[0]
        if entry is not None:  # named on an agent that died
            self._tags.pop(entry[0].key, None)
        spec = new_channel(self.address)
        generation = self.agent.command(apb.AgentCommand(accept=apb.AgentAccept(channel=channel_to_proto(spec))))
        self._channels[peer] = (spec, generation)
        return spec

    def next_tag(self, channel: ChannelSpec) -> int:
        return next(self._tags.setdefault(channel.key, itertools.count(AUTH_TAG + 1)))

    def _live(self, channel: ChannelSpec) -> bool:
        return any(s == channel and g == self.agent.generation for s, g in self._channels.values())

    async def recv(self, channel: ChannelSpec, tag: int, buffer: torch.Tensor, drain: Drain | None = None) -> Moved:
        _check_tag(tag)
        if not self._live(channel):
            raise TransferError(TransferFailure.CLOSED, f"channel {channel.key} was dropped (or its KV agent died)")
        start, segment = time.monotonic(), _SEGMENTS.take(buffer)
        command = apb.AgentRecv(channel=channel_to_proto(channel), tag=tag, tensor=tensor_to_proto(buffer))
        call_id, call = self.agent.call(apb.AgentCommand(recv=command), segment.fd)
        rows, landing = row_view(buffer), row_view(segment.view(buffer))
        ended = False  # the agent is done with the segment

        def land(landed: slice) -> None:
            rows[landed].copy_(landing[landed])
            if drain is not None:
                drain(landed)

        try:
            while (event := await call.events.get()) is not None and event.HasField("landed"):
                await _copy(land, slice(event.landed.start, event.landed.stop))
            ended = True
            if event is None or event.HasField("failed"):
                raise _failure(event, "receiver", channel)
            return Moved(time.monotonic() - start, event.moved.checksum)
        except asyncio.CancelledError:  # the caller is gone; the agent's receive ends by itself
            self.agent.command(apb.AgentCommand(call_id=call_id, cancel=apb.AgentCancel()))
            raise
        finally:
            self.agent.end(call_id)
            _SEGMENTS.give(segment) if ended else segment.close()

    def drop(self, channel: ChannelSpec) -> None:
        for peer, (spec, _) in list(self._channels.items()):
            if spec == channel:
                del self._channels[peer]
                self._tags.pop(spec.key, None)
                self.agent.command(apb.AgentCommand(drop=apb.AgentDrop(channel=channel_to_proto(spec))))

    def close(self) -> None:
        self.agent.close()
        self._listener.close()


class AgentSender(KVSender):
    """Prefill side: gloo in a KV agent. Channels joined on an agent that died are refused as closed."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        timeout_s: float = 30.0,
        device: torch.device | None = None,
        max_channels: int = 4096,
    ) -> None:
        self.timeout_s = timeout_s
        self.agent = KVAgent("sender", host, timeout_s)
        # each channel's agent generation; bounded: receivers name a new key per channel
        self._joined: RecentMap[str, int] = RecentMap(max_channels)

    def connect(self, channel: ChannelSpec) -> None:
        if channel.key in self._joined:
            return
        generation = self.agent.command(apb.AgentCommand(connect=apb.AgentConnect(channel=channel_to_proto(channel))))
        self._joined.set(channel.key, generation)

    async def send(self, channel: ChannelSpec, tag: int, blocks: torch.Tensor, fill: Fill | None = None) -> Moved:
        _check_tag(tag)
        self.connect(channel)
        if self._joined.get(channel.key) != self.agent.generation:
            raise TransferError(TransferFailure.CLOSED, f"channel {channel.key} was joined by a KV agent that died")
        start, segment = time.monotonic(), _SEGMENTS.take(blocks)
        rows, outgoing = row_view(blocks), segment.view(blocks)
        ended = False  # the agent is done with the segment

        def filled(chunk: slice) -> None:
            if fill is not None:
                fill(chunk)
            row_view(outgoing)[chunk].copy_(rows[chunk])

        try:
            if fill is None:
                await _copy(outgoing.copy_, blocks)
            command = apb.AgentSend(
                channel=channel_to_proto(channel), tag=tag, tensor=tensor_to_proto(blocks), fill=fill is not None
            )
            call_id, call = self.agent.call(apb.AgentCommand(send=command), segment.fd)
        except BaseException:
            _SEGMENTS.give(segment)  # the agent never had it
            raise
        try:
            while (event := await call.events.get()) is not None and event.HasField("fill"):
                error = ""
                try:
                    await _copy(filled, slice(event.fill.start, event.fill.stop))
                except Exception as e:  # the agent's send fails with it
                    error = f"{type(e).__name__}: {e}"
                self.agent.command(apb.AgentCommand(call_id=call_id, filled=apb.AgentFilled(error=error)))
            ended = True
            if event is None or event.HasField("failed"):
                raise _failure(event, "sender", channel)
            return Moved(time.monotonic() - start, event.moved.checksum)
        except asyncio.CancelledError:  # the caller is gone: nothing more is filled; the agent ends the send
            self.agent.command(apb.AgentCommand(call_id=call_id, cancel=apb.AgentCancel()))
            raise
        finally:
            self.agent.end(call_id)
            _SEGMENTS.give(segment) if ended else segment.close()

    def close(self) -> None:
        self.agent.close()


def make_receiver(host: str, timeout_s: float, device: torch.device | None = None) -> AgentReceiver | TorchDistReceiver:
    """A worker's KV receiver, once it serves: in a KV agent for KV in host memory (a worker is ready
    only once its agents are); in this process, with NCCL channels, for KV on CUDA."""
    if device is not None and device.type == "cuda":
        return TorchDistReceiver(host, timeout_s, device)
    receiver = AgentReceiver(host, timeout_s)
    receiver.agent.wait_ready(AGENT_START_TIMEOUT_S)  # so no transfer's wait starts before its agent serves
    return receiver


def make_sender(host: str, timeout_s: float, device: torch.device | None = None) -> AgentSender | TorchDistSender:
    """A worker's KV sender (as make_receiver)."""
    if device is not None and device.type == "cuda":
        return TorchDistSender(host, timeout_s, device)
    sender = AgentSender(host, timeout_s)
    sender.agent.wait_ready(AGENT_START_TIMEOUT_S)
    return sender
