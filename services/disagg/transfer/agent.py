"""The KV agent: a child process of a worker (or of one of its ranks) that holds that process's side of
the KV plane, so that nothing another local user can do to the plane reaches the worker itself.

Why a process: gloo aborts the whole process when its listener's accept() fails (e.g. out of file
descriptors: ~1,200 idle connections from anyone) or when a peer on a pair sends more than a posted
receive holds, and torch's TCPStore holds whatever anyone writes into it (issue 35 items 3 and 5).
Neither can be told whom to accept. Here they run in the agent: when it dies, the worker's transfers
on it fail (the requests recompute their prompts, as for any failed transfer) and the worker starts a
new agent (isolated.py); the agent's memory is bounded (Budget), so a store filled by someone
else ends the agent, never the worker.

    python -m splitserve.services.disagg.transfer.agent {receiver,sender} HOST TIMEOUT_S SOCKET_FD STORE_FD DATA_BYTES

SOCKET_FD: the agent's end of a SOCK_SEQPACKET socketpair with its worker (protos/v1/kv_agent.proto:
AgentCommand in, AgentEvent out, one message per packet). STORE_FD: a receiver's store socket,
listening on HOST, which the worker keeps across agents so the store's address never changes (-1 for
a sender). DATA_BYTES: the agent's data (heap) allowed beyond what it holds once started. Nothing
secret is on the command line: channel secrets come over the socketpair.

Each transfer's tensor is a memfd segment the worker made (its descriptor rides the command): the
agent moves the bytes between the segment and the wire with TorchDistReceiver/TorchDistSender
(gloo), and tells the worker which rows have landed (AgentLanded) or asks it for the rows to send
next (AgentFill), so the worker's copies overlap the wire as in one process.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import mmap
import os
import queue
import resource
import socket
import sys
import threading
from collections.abc import Callable

import torch

from splitserve.protos.v1 import kv_agent_pb2 as apb
from splitserve.services.disagg.transfer.base import Backend, ChannelSpec, KVReceiver, KVSender, Moved, TransferError
from splitserve.services.disagg.transfer.torch_dist import TorchDistReceiver, TorchDistSender

log = logging.getLogger("splitserve.kv_agent")
MAX_PACKET_BYTES = 1 << 16  # a command is a few hundred bytes
THREAD_STACK_BYTES = 1 << 20  # the transfer threads' stacks count in the data limit
EXIT_FULL = 3  # the agent's exit code when its memory is past its budget (Budget)


def channel_to_proto(spec: ChannelSpec) -> apb.AgentChannel:
    return apb.AgentChannel(address=spec.address, key=spec.key, secret=spec.secret)


def channel_from_proto(channel: apb.AgentChannel) -> ChannelSpec:
    return ChannelSpec(channel.address, channel.key, channel.secret, Backend.GLOO)


def tensor_to_proto(tensor: torch.Tensor) -> apb.AgentTensor:
    return apb.AgentTensor(shape=tensor.shape, dtype=str(tensor.dtype).removeprefix("torch."))


def map_segment(fd: int, spec: apb.AgentTensor) -> torch.Tensor:
    """The segment behind fd as a tensor of spec's shape and dtype (the mapping outlives the fd, and
    goes with the last view of it)."""
    dtype = getattr(torch, spec.dtype)
    numel = 1
    for size in spec.shape:
        numel *= size
    num_bytes = numel * dtype.itemsize
    if not num_bytes:
        return torch.empty(tuple(spec.shape), dtype=dtype)
    # populated: one call maps every page the worker already touched, instead of a fault per page
    mapping = mmap.mmap(fd, num_bytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
    flat = torch.frombuffer(mapping, dtype=torch.uint8, count=num_bytes)
    return flat.view(dtype).view(tuple(spec.shape))


class Wire:
    """The socketpair to the worker: packets out from any thread, one reader."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock, self._lock = sock, threading.Lock()

    def send(self, event: apb.AgentEvent) -> None:
        with self._lock:
            self._sock.send(event.SerializeToString())

    def read(self) -> tuple[apb.AgentCommand, list[int]] | None:
        """The next command and the descriptors beside it; None once the worker is gone."""
        try:
            data, fds, _, _ = socket.recv_fds(self._sock, MAX_PACKET_BYTES, 4)
        except OSError:
            return None
        return (apb.AgentCommand.FromString(data), fds) if data else None


class Agent:
    """Runs the worker's commands on its transport, each transfer as a task on this loop."""

    def __init__(
        self, transport: KVReceiver | KVSender, wire: Wire, loop: asyncio.AbstractEventLoop, budget: Budget
    ) -> None:
        self.transport, self.wire, self.loop, self.budget = transport, wire, loop, budget
        self._calls: dict[int, asyncio.Task] = {}
        self._fills: dict[int, queue.SimpleQueue[str]] = {}  # a send's answers to its AgentFill, by call

    def dispatch(self, command: apb.AgentCommand, fds: list[int]) -> None:
        kind, call_id = command.WhichOneof("command"), command.call_id
        if kind in ("accept", "connect"):
            self.budget.exit_if_full()
        if kind == "accept":
            assert isinstance(self.transport, TorchDistReceiver)
            spec = channel_from_proto(command.accept.channel)
            self.transport.accept(spec.key, spec)
        elif kind == "connect":
            assert isinstance(self.transport, KVSender)
            self.transport.connect(channel_from_proto(command.connect.channel))
        elif kind == "drop":
            if isinstance(self.transport, KVReceiver):
                self.transport.drop(channel_from_proto(command.drop.channel))
        elif kind in ("recv", "send"):
            self._start(call_id, kind, getattr(command, kind), fds[0])
            fds = fds[1:]
        elif kind == "filled":
            fill = self._fills.get(call_id)
            if fill is not None:
                fill.put(command.filled.error)
        elif kind == "cancel":  # the worker fills no more rows: a send still filling fails at once
            task, fill = self._calls.get(call_id), self._fills.get(call_id)
            if fill is not None:
                fill.put("the call was cancelled")
            if task is not None:
                task.cancel()
        for fd in fds:  # none expected: never leak one
            os.close(fd)

    def _start(self, call_id: int, kind: str, command, fd: int) -> None:
        try:
            tensor = map_segment(fd, command.tensor)
        finally:
            os.close(fd)
        spec = channel_from_proto(command.channel)
        if kind == "recv":
            assert isinstance(self.transport, KVReceiver)
            work = self.transport.recv(spec, command.tag, tensor, self._landed(call_id))
        else:
            assert isinstance(self.transport, KVSender)
            fill = self._filler(call_id) if command.fill else None
            work = self.transport.send(spec, command.tag, tensor, fill)
        self._calls[call_id] = self.loop.create_task(self._run(call_id, work))

    async def _run(self, call_id: int, work) -> None:
        try:
            moved: Moved = await work
            event = apb.AgentEvent(
                call_id=call_id, moved=apb.AgentMoved(seconds=moved.seconds, checksum=moved.checksum)
            )
        except TransferError as e:
            event = apb.AgentEvent(call_id=call_id, failed=apb.AgentFailed(reason=e.reason.value, message=str(e)))
        except asyncio.CancelledError:
            event = apb.AgentEvent(call_id=call_id, failed=apb.AgentFailed(reason="closed", message="cancelled"))
        except Exception as e:  # a bug: this call ends, the agent serves on
            log.exception("KV agent call %d failed", call_id)
            message = f"{type(e).__name__}: {e}"
            event = apb.AgentEvent(call_id=call_id, failed=apb.AgentFailed(reason="peer_lost", message=message))
        finally:
            self._calls.pop(call_id, None)
            self._fills.pop(call_id, None)
        self.wire.send(event)

    def _landed(self, call_id: int) -> Callable[[slice], None]:
        def landed(rows: slice) -> None:  # on the transfer's thread, once the rows are in the segment
            self.wire.send(apb.AgentEvent(call_id=call_id, landed=apb.AgentRows(start=rows.start, stop=rows.stop)))

        return landed

    def _filler(self, call_id: int) -> Callable[[slice], None]:
        answers = self._fills[call_id] = queue.SimpleQueue()

        def fill(rows: slice) -> None:  # on the transfer's helper thread, before it sends the rows
            self.wire.send(apb.AgentEvent(call_id=call_id, fill=apb.AgentRows(start=rows.start, stop=rows.stop)))
            error = answers.get()
            if error:
                raise RuntimeError(f"the worker could not fill rows {rows.start}:{rows.stop}: {error}")

        return fill


def _data_bytes() -> int:
    """VmData: the agent's private writable memory (heap, thread stacks; not the shared segments)."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmData:"))


class Budget:
    """The agent's memory bound. RLIMIT_DATA caps it at what it held once started plus extra_bytes, so
    a store filled by anyone fails allocations here, never in the worker; and an agent past half of
    extra_bytes exits before it takes its next channel (its store then holds what someone else wrote:
    a full agent would only fail every transfer), so its worker starts a fresh one."""

    def __init__(self, extra_bytes: int) -> None:
        held = _data_bytes()
        self.limit_bytes, self.full_bytes = held + extra_bytes, held + extra_bytes // 2
        resource.setrlimit(resource.RLIMIT_DATA, (self.limit_bytes, self.limit_bytes))

    def exit_if_full(self) -> None:
        if (held := _data_bytes()) > self.full_bytes:
            log.warning("KV agent holds %d MiB (its store's writes): exiting for a fresh one", held >> 20)
            os._exit(EXIT_FULL)


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="splitserve.services.disagg.transfer.agent")
    parser.add_argument("role", choices=("receiver", "sender"))
    parser.add_argument("host")
    parser.add_argument("timeout_s", type=float)
    parser.add_argument("socket_fd", type=int)
    parser.add_argument("store_fd", type=int)
    parser.add_argument("data_bytes", type=int)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = _parse(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    threading.stack_size(THREAD_STACK_BYTES)
    wire = Wire(socket.socket(fileno=args.socket_fd))
    transport: KVReceiver | KVSender
    if args.role == "receiver":
        receiver = TorchDistReceiver(args.host, args.timeout_s, listener=socket.socket(fileno=args.store_fd))
        transport, address = receiver, receiver.address
    else:
        transport, address = TorchDistSender(args.host, args.timeout_s), ""
    budget = Budget(args.data_bytes)
    try:
        wire.send(apb.AgentEvent(ready=apb.AgentReady(store_address=address)))
    except OSError:  # the worker is gone already
        os._exit(0)
    asyncio.run(_serve(transport, wire, budget))


async def _serve(transport: KVReceiver | KVSender, wire: Wire, budget: Budget) -> None:
    """Until the worker closes its end (or dies: the socketpair closes with it)."""
    loop = asyncio.get_running_loop()
    agent = Agent(transport, wire, loop, budget)
    gone = loop.create_future()

    def read() -> None:
        while (message := wire.read()) is not None:
            loop.call_soon_threadsafe(agent.dispatch, *message)
        loop.call_soon_threadsafe(gone.set_result, None)

    threading.Thread(target=read, name="kv-agent-commands", daemon=True).start()
    await gone
    transport.close()
    os._exit(0)  # not waiting for transfer threads the worker no longer hears from


if __name__ == "__main__":
    main()
