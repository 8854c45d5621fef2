"""The KV transfer plane against someone who can reach it: the store and gloo listen on the given
host only, and a process that reads the store (list_keys), joins a channel first, or rewrites the
published addresses to sit between the two ranks gets no KV in and none out. The attackers run
in separate processes (this file run as a script: `python tests/integration/test_transfer_security.py join-first
HOST:PORT`)."""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from splitserve.services.disagg.transfer import chunks, torch_dist
from splitserve.services.disagg.transfer.base import ChannelSpec, TransferError, TransferFailure
from splitserve.services.disagg.transfer.torch_dist import TorchDistReceiver, TorchDistSender

SHAPE = (2, 2, 3, 4, 2, 8)  # [layers, K/V, blocks, block_size, kv_heads, head_dim]
TIMEOUT_S = 5.0
FORGED = 7.0  # what the attackers send as KV
NOTHING_S = timedelta(seconds=2)  # how long a side waits to be sure KV it should not get never comes
KV_WIRE_TAG = chunks.wire_tag(1, 0)  # where transfer tag 1 of SHAPE (one chunk) travels on the pair


# --- what this process listens on ------------------------------------------------------------


def _listening_addresses() -> dict[int, set[ipaddress.IPv4Address | ipaddress.IPv6Address]]:
    """port -> addresses of the TCP sockets this process listens on (from /proc)."""
    inodes = set()
    for fd in Path("/proc/self/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:  # closed since listed
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found: dict[int, set] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and inode in inodes:  # 0A: LISTEN
                address, port = local.split(":")
                found.setdefault(int(port, 16), set()).add(_decode(address))
    return found


def _decode(hex_address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    raw = bytes.fromhex(hex_address)  # printed one 32-bit word at a time, in host (little-endian) order
    return ipaddress.ip_address(b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4)))


def _non_loopback_ipv4() -> str | None:
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the outgoing interface
        address = probe.getsockname()[0]
    except OSError:
        return None
    finally:
        probe.close()
    return None if address.startswith("127.") else address


def test_store_and_gloo_sockets_listen_on_the_given_host_only():
    before = _listening_addresses()

    async def main():
        receiver, sender = TorchDistReceiver(timeout_s=TIMEOUT_S), TorchDistSender(timeout_s=TIMEOUT_S)
        channel = receiver.channel_for("prefill-a")
        buffer, data = torch.zeros(SHAPE), torch.randn(SHAPE)
        await asyncio.gather(receiver.recv(channel, 1, buffer), sender.send(channel, 1, data))
        assert torch.equal(buffer, data)
        return receiver, sender

    receiver, sender = asyncio.run(main())
    opened = {port: hosts for port, hosts in _listening_addresses().items() if port not in before}
    assert receiver.store.port in opened
    assert len(opened) >= 2  # the store and gloo's listener(s)
    assert all(hosts == {ipaddress.ip_address("127.0.0.1")} for hosts in opened.values()), opened
    other = _non_loopback_ipv4()
    if other is not None:  # reachable from this machine's other address before the fix (`*:port`)
        for port in opened:
            with pytest.raises(ConnectionRefusedError):
                socket.create_connection((other, port), timeout=2).close()
    receiver.close(), sender.close()


# --- attackers ----------------------------------------------------------------------------------


def _start_attacker(kind: str, address: str) -> subprocess.Popen:
    attacker = subprocess.Popen(
        [sys.executable, __file__, kind, address], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    assert attacker.stdout is not None
    assert attacker.stdout.readline().strip() == "ready"  # imported torch and connected to the store
    return attacker


def _report(attacker: subprocess.Popen) -> dict:
    out, _ = attacker.communicate(timeout=4 * TIMEOUT_S)
    return json.loads(out.strip().splitlines()[-1])


def _wait_for_line(attacker: subprocess.Popen, expected: str) -> None:
    assert attacker.stdout is not None
    assert attacker.stdout.readline().strip() == expected


def test_a_process_that_lists_the_keys_and_joins_first_gets_no_kv_in():
    async def main():
        receiver, sender = TorchDistReceiver(timeout_s=TIMEOUT_S), TorchDistSender(timeout_s=TIMEOUT_S)
        attacker = _start_attacker("join-first", receiver.address)
        channel = receiver.channel_for("prefill-a")
        buffer = torch.zeros(SHAPE)
        with pytest.raises(TransferError) as refused:
            await receiver.recv(channel, receiver.next_tag(channel), buffer)
        report = _report(attacker)
        # The request is unharmed: its retry on a fresh channel moves the real KV.
        receiver.drop(channel)
        fresh = receiver.channel_for("prefill-a")
        data = torch.randn(SHAPE)
        tag = receiver.next_tag(fresh)
        await asyncio.gather(receiver.recv(fresh, tag, buffer), sender.send(fresh, tag, data))
        receiver.close(), sender.close()
        return refused.value, report, buffer, data, channel

    error, report, buffer, data, channel = asyncio.run(main())
    assert report["key"] == channel.key and report["joined"]  # it did read the store and join first
    assert error.reason is TransferFailure.AUTH
    assert report["receiver_proof"] == ""  # refused, and told so
    assert torch.equal(buffer, data)  # only the real transfer landed; the forged one never did


def test_a_process_that_rewrites_the_addresses_to_sit_between_is_refused_by_both():
    async def main():
        receiver, sender = TorchDistReceiver(timeout_s=TIMEOUT_S), TorchDistSender(timeout_s=TIMEOUT_S)
        attacker = _start_attacker("sit-between", receiver.address)
        channel = receiver.channel_for("prefill-a")
        _wait_for_line(attacker, "between")  # paired with the receiver, waiting for the sender
        buffer, data = torch.zeros(SHAPE), torch.randn(SHAPE)
        outcomes = await asyncio.gather(
            receiver.recv(channel, 1, buffer), sender.send(channel, 1, data), return_exceptions=True
        )
        receiver.close(), sender.close()
        return outcomes, _report(attacker), buffer

    (received, sent), report, buffer = asyncio.run(main())
    assert report["relayed_nonce"]  # it did sit between the two and relayed the receiver's challenge
    assert isinstance(received, TransferError) and received.reason is TransferFailure.AUTH
    assert isinstance(sent, TransferError) and sent.reason is TransferFailure.AUTH
    assert not report["kv_seen"]  # the sender sent it nothing
    assert not buffer.any()


def test_a_sender_with_the_wrong_secret_is_refused_and_the_right_one_admitted():
    async def main():
        receiver, sender = TorchDistReceiver(timeout_s=TIMEOUT_S), TorchDistSender(timeout_s=TIMEOUT_S)
        channel = receiver.channel_for("prefill-a")
        wrong = dataclasses.replace(channel, secret=bytes(32))
        buffer, data = torch.zeros(SHAPE), torch.randn(SHAPE)
        outcomes = await asyncio.gather(
            receiver.recv(channel, 1, buffer), sender.send(wrong, 1, data), return_exceptions=True
        )
        untouched = not buffer.any()
        receiver.drop(channel)
        fresh = receiver.channel_for("prefill-a")
        await asyncio.gather(receiver.recv(fresh, 2, buffer), sender.send(fresh, 2, data))
        receiver.close(), sender.close()
        return outcomes, untouched, buffer, data

    (received, sent), untouched, buffer, data = asyncio.run(main())
    assert isinstance(received, TransferError) and received.reason is TransferFailure.AUTH
    assert isinstance(sent, TransferError) and sent.reason is TransferFailure.AUTH
    assert untouched
    assert torch.equal(buffer, data)


def test_the_sender_sends_nothing_to_a_receiver_that_cannot_prove_the_secret():
    impostor = TorchDistReceiver(timeout_s=TIMEOUT_S)  # only for its store: it plays the receiver by hand
    channel = ChannelSpec(impostor.address, "impostor", os.urandom(32))
    seen: list[str] = []

    def play_receiver() -> None:
        scoped = dist.PrefixStore(f"kv/{channel.key}", impostor.store)
        group = _attacker_group(scoped, torch_dist.RECEIVER_RANK)
        nonce = torch.zeros(torch_dist.NONCE_BYTES, dtype=torch.uint8)
        group.send([nonce], torch_dist.SENDER_RANK, torch_dist.AUTH_TAG).wait()
        scoped.wait([torch_dist.SENDER_PROOF])
        scoped.set(torch_dist.RECEIVER_PROOF, os.urandom(32))  # a guess
        try:
            group.recv([torch.zeros(SHAPE)], torch_dist.SENDER_RANK, KV_WIRE_TAG).wait(NOTHING_S)
            seen.append("kv")
        except RuntimeError:
            seen.append("nothing")

    player = threading.Thread(target=play_receiver)
    player.start()
    sender = TorchDistSender(timeout_s=TIMEOUT_S)
    with pytest.raises(TransferError) as refused:
        asyncio.run(sender.send(channel, 1, torch.randn(SHAPE)))
    player.join()
    assert refused.value.reason is TransferFailure.AUTH
    assert seen == ["nothing"]
    sender.close()


def test_tag_zero_is_reserved_for_the_handshake():
    receiver = TorchDistReceiver(timeout_s=TIMEOUT_S)
    channel = receiver.channel_for("prefill-a")
    assert receiver.next_tag(channel) >= 1
    with pytest.raises(ValueError, match="tag 0"):
        asyncio.run(receiver.recv(channel, 0, torch.zeros(SHAPE)))
    receiver.close()


# --- the attackers' side (run in a separate process) ------------------------------------------


class _Tap(dist.Store):
    """The attacker's view of the store: tells when it publishes under `announce`, and holds a read
    of a key back until the key no longer holds the value in `stale`."""

    def __init__(self, store: dist.Store, stale: dict[str, bytes] | None = None, announce: str = "") -> None:
        super().__init__()
        self.store, self.stale, self.announce = store, stale or {}, announce
        self.published: dict[str, bytes] = {}

    def set(self, key: str, value: bytes) -> None:
        self.published[key] = bytes(value)
        self.store.set(key, value)
        if key == self.announce:
            print("between", flush=True)

    def get(self, key: str) -> bytes:
        value = self.store.get(key)
        while self.stale.get(key) == value:
            time.sleep(0.01)
            value = self.store.get(key)
        return value

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self.store.wait(keys) if timeout is None else self.store.wait(keys, timeout)

    def add(self, key: str, amount: int) -> int:
        return self.store.add(key, amount)

    def check(self, keys: list[str]) -> bool:
        return self.store.check(keys)


def _attacker_group(store: dist.Store, rank: int) -> dist.ProcessGroupGloo:
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1", lazy_init=False)]
    options._timeout = timedelta(seconds=TIMEOUT_S)
    return dist.ProcessGroupGloo(store, rank, 2, options)


def _first_channel(store: dist.TCPStore) -> str:
    """Reads the key of the first channel that appears, as anyone who reaches the store can."""
    while True:
        for name in store.list_keys():
            if found := re.match(r"kv/([^/]+)/", name):
                return found.group(1)
        time.sleep(0.01)


def _connect(address: str) -> dist.TCPStore:
    host, port = address.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=TIMEOUT_S))
    print("ready", flush=True)
    return store


def _join_first(address: str) -> dict:
    """Joins the receiver's channel as its sender, answers with a forged proof, sends forged KV."""
    store = _connect(address)
    key = _first_channel(store)
    scoped = dist.PrefixStore(f"kv/{key}", store)
    group = _attacker_group(scoped, torch_dist.SENDER_RANK)
    nonce = group.recv([torch.zeros(torch_dist.NONCE_BYTES, dtype=torch.uint8)], torch_dist.RECEIVER_RANK, 0)
    scoped.set(torch_dist.SENDER_PROOF, os.urandom(32))
    forged = group.send([torch.full(SHAPE, FORGED)], torch_dist.RECEIVER_RANK, KV_WIRE_TAG)
    for work in (nonce, forged):
        try:
            work.wait(NOTHING_S)
        except RuntimeError:  # the receiver shut the group down, or never took it
            pass
    scoped.wait([torch_dist.RECEIVER_PROOF])
    return {"key": key, "joined": True, "receiver_proof": scoped.get(torch_dist.RECEIVER_PROOF).hex()}


def _sit_between(address: str) -> dict:
    """Publishes its own addresses for both ranks, pairs with each, and relays between them."""
    store = _connect(address)
    scoped = dist.PrefixStore(f"kv/{_first_channel(store)}", store)
    as_sender = _Tap(scoped)
    to_receiver = _attacker_group(as_sender, torch_dist.SENDER_RANK)  # the receiver now reads our address
    nonce = torch.zeros(torch_dist.NONCE_BYTES, dtype=torch.uint8)
    challenge = to_receiver.recv([nonce], torch_dist.RECEIVER_RANK, 0)
    # Overwrite the receiver's address before the real sender reads it; read the sender's once it arrives.
    as_receiver = _Tap(scoped, stale={"0/0": as_sender.published["0/0"]}, announce="0/1")
    to_sender = _attacker_group(as_receiver, torch_dist.RECEIVER_RANK)
    challenge.wait()
    to_sender.send([nonce], torch_dist.SENDER_RANK, 0).wait()
    kv = torch.zeros(SHAPE)
    try:
        to_sender.recv([kv], torch_dist.SENDER_RANK, KV_WIRE_TAG).wait(NOTHING_S)
        kv_seen = True
    except RuntimeError:
        kv_seen = False
    return {"relayed_nonce": True, "kv_seen": kv_seen}


if __name__ == "__main__":
    attack = {"join-first": _join_first, "sit-between": _sit_between}[sys.argv[1]]
    print(json.dumps(attack(sys.argv[2])), flush=True)
