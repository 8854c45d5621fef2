"""The KV plane's attackers and a victim, run as scripts (the attackers as user nobody, see as_user.py):

python kv_attacks.py flood N PORT...          N idle connections to each port; prints `planted K`,
                                              holds them until a line on stdin
python kv_attacks.py read-store HOST:PORT     every key of the store and its value (JSON, hex)
python kv_attacks.py write-store HOST:PORT N  N bytes into the store, 4 MiB a key (JSON)
python kv_attacks.py victim                   a receiver and a sender in one process, with the usual
                                              1024 open files; prints `ports P...` (its gloo
                                              listeners), then on a line from stdin moves one
                                              transfer and prints `moved True`
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import socket
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
    store, piece = _store(address), 4 << 20
    for offset in range(0, num_bytes, piece):
        store.set(f"attack/{offset}", b"\0" * min(piece, num_bytes - offset))
    return {"written": sum(len(store.get(key)) for key in store.list_keys() if key.startswith("attack/"))}


def victim() -> None:
    import torch

    from splitserve.disagg.transfer.torch_dist import TorchDistReceiver, TorchDistSender

    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    before = _listening_ports()
    receiver, sender = TorchDistReceiver(timeout_s=TIMEOUT_S), TorchDistSender(timeout_s=TIMEOUT_S)
    gloo = sorted(_listening_ports() - before - {receiver.store.port})
    print("ports", *gloo, flush=True)
    sys.stdin.readline()

    async def move() -> bool:
        channel = receiver.channel_for("prefill-a")
        buffer, data = torch.zeros(SHAPE), torch.randn(SHAPE)
        tag = receiver.next_tag(channel)
        await asyncio.gather(receiver.recv(channel, tag, buffer), sender.send(channel, tag, data))
        return torch.equal(buffer, data)

    print("moved", asyncio.run(move()), flush=True)


def _listening_ports() -> set[int]:
    """Ports this process listens on (its sockets' inodes in /proc/net/tcp, as test_transfer_security reads)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
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
    if kind == "flood":
        flood(int(args[0]), [int(p) for p in args[1:]])
    elif kind == "victim":
        victim()
    elif kind == "read-store":
        print(json.dumps(read_store(args[0])), flush=True)
    elif kind == "write-store":
        print(json.dumps(write_store(args[0], int(args[1]))), flush=True)
    else:
        raise SystemExit(f"unknown attack {kind!r}")
