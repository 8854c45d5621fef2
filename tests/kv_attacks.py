"""The KV plane's attackers and a victim, run as scripts (the attackers as user nobody, see as_user.py):

python kv_attacks.py flood N PORT...          N idle connections to each port; prints `planted K`,
                                              holds them until a line on stdin
python kv_attacks.py plant N PORT...          to each port, N connections each naming one of gloo's
                                              pair sequence numbers 0..N-1 (as a peer would) then
                                              sending a malformed message, so the pairs that wait for
                                              those numbers get them; prints `planted K`, holds them
                                              until a line on stdin
python kv_attacks.py read-store HOST:PORT     every key of the store and its value (JSON, hex)
python kv_attacks.py write-store HOST:PORT N  N bytes into the store, 4 MiB a key (JSON)
python kv_attacks.py victim                   a worker's receiver and sender (each with its KV
                                              agent, as workers run them), with the usual 1024
                                              open files: moves one transfer, prints `ports P...`
                                              (the agents' gloo listeners then), and on a line
                                              from stdin moves one more on a new channel (a failed
                                              one is retried on the next, as the decode worker
                                              recomputes and hands off the next request); prints
                                              `moved True FAILED`
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import socket
import struct
import sys
from datetime import timedelta

SHAPE = (2, 2, 3, 4, 2, 8)  # [layers, K/V, blocks, block_size, kv_heads, head_dim]
TIMEOUT_S = 10.0


def flood(count: int, ports: list[int]) -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # an unprivileged user may go up to the hard limit
    held = []
    for port in ports:
        for _ in range(count):
            try:
                held.append(socket.create_connection(("127.0.0.1", port), timeout=5))
            except OSError:  # the listener is gone (its process died) or full
                break
    print("planted", len(held), flush=True)
    sys.stdin.readline()


def plant(count: int, ports: list[int]) -> None:
    held = []
    for port in ports:
        for sequence in range(count):
            try:
                sock = socket.create_connection(("127.0.0.1", port), timeout=5)
                sock.sendall(struct.pack("<Q", sequence) + b"\xff" * 64)  # a pair's header, then garbage
                held.append(sock)
            except OSError:  # the listener is gone (its process died)
                break
    print("planted", len(held), flush=True)
    sys.stdin.readline()


def _store(address: str):
    import torch.distributed as dist

    host, port = address.rsplit(":", 1)
    return dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=TIMEOUT_S))


def read_store(address: str) -> dict:
    store = _store(address)
    return {key: store.get(key).hex() for key in store.list_keys()}


def write_store(address: str, num_bytes: int) -> dict:
    """num_bytes in values of 4 MiB under keys of its own (the store resets a connection that sends one
    value of more than about 10 MiB, not one that sends many)."""
    store, piece, written = _store(address), 4 << 20, 0
    try:
        for offset in range(0, num_bytes, piece):
            store.set(f"attack/{offset}", b"\0" * min(piece, num_bytes - offset))
            written += min(piece, num_bytes - offset)
        return {"written": sum(len(store.get(key)) for key in store.list_keys() if key.startswith("attack/"))}
    except Exception as e:  # the store went away under the writes
        return {"written": written, "error": f"{type(e).__name__}: {e}"[:200]}


async def move_once(receiver, sender) -> None:
    """One transfer of SHAPE on a new channel; its bytes arrive whole (the tests' known-good transfer)."""
    import torch

    channel = receiver.channel_for("prefill-a")
    buffer, data = torch.zeros(SHAPE), torch.randn(SHAPE)
    tag = receiver.next_tag(channel)
    await asyncio.gather(receiver.recv(channel, tag, buffer), sender.send(channel, tag, data))
    assert torch.equal(buffer, data)


def victim() -> None:
    import torch

    from splitserve.services.disagg.transfer.base import TransferError
    from splitserve.services.disagg.transfer.isolated import AgentReceiver, AgentSender

    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    receiver, sender = AgentReceiver(timeout_s=TIMEOUT_S), AgentSender(timeout_s=TIMEOUT_S)

    async def move() -> tuple[bool, int]:
        """One transfer on a new channel, retried on the next as the decode worker recomputes a failed
        handoff and names a new channel for the next one."""
        for failed in range(3):
            channel = receiver.channel_for("prefill-a")
            buffer, data = torch.zeros(SHAPE), torch.randn(SHAPE)
            tag = receiver.next_tag(channel)
            ends = await asyncio.gather(
                receiver.recv(channel, tag, buffer), sender.send(channel, tag, data), return_exceptions=True
            )
            receiver.drop(channel)
            errors = [e for e in ends if isinstance(e, TransferError)]
            if not errors:
                return torch.equal(buffer, data), failed
            for e in errors:
                print(f"attempt {failed}: {e.reason.value}: {e}", file=sys.stderr, flush=True)
        return False, 3

    print("warm", *asyncio.run(move()), flush=True)
    store_port = int(receiver.address.rsplit(":", 1)[1])
    agents = [receiver.agent.wait_ready(TIMEOUT_S), sender.agent.wait_ready(TIMEOUT_S)]
    print("ports", *sorted(p for pid in agents for p in _listening_ports(pid) if p != store_port), flush=True)
    sys.stdin.readline()
    print("moved", *asyncio.run(move()), flush=True)


def _listening_ports(pid: int | str = "self") -> set[int]:
    """Ports a process listens on (its sockets' inodes in /proc/net/tcp, as test_transfer_security reads)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed since listed
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as lines:
            for line in list(lines)[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                    ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


if __name__ == "__main__":
    kind, args = sys.argv[1], sys.argv[2:]
    if kind in ("flood", "plant"):
        (flood if kind == "flood" else plant)(int(args[0]), [int(p) for p in args[1:]])
    elif kind == "victim":
        victim()
    elif kind == "read-store":
        print(json.dumps(read_store(args[0])), flush=True)
    elif kind == "write-store":
        print(json.dumps(write_store(args[0], int(args[1]))), flush=True)
    else:
        raise SystemExit(f"unknown attack {kind!r}")
