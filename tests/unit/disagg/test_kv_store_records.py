"""What the KV plane leaves in its TCPStore, in this process: no keys once a channel is built or
dropped, and gloo's address records carry no uninitialised memory (the attacks themselves, as
another user: tests/integration/test_security_attacks.py)."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import torch.distributed as dist
from kv_attacks import move_once

from splitserve.common.dist_store import gloo_device
from splitserve.services.disagg.transfer import torch_dist
from splitserve.services.disagg.transfer.base import ChannelSpec
from splitserve.services.disagg.transfer.torch_dist import TorchDistReceiver, TorchDistSender

TIMEOUT_S = 5.0
BOUND_S = 60.0  # an upper bound that only a broken run reaches
SOCKADDR_STORAGE_BYTES = 128  # Linux's; gloo's address record is one, then a u64 sequence number
GLOO_ADDRESS_BYTES = SOCKADDR_STORAGE_BYTES + 8


def _wait_until(done, what: str) -> None:
    deadline = time.monotonic() + BOUND_S
    while not done():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


# --- item 5: the store keeps no channel's keys --------------------------------------------------
def test_a_built_channel_leaves_no_keys_in_the_store():
    receiver, sender = TorchDistReceiver(timeout_s=TIMEOUT_S), TorchDistSender(timeout_s=TIMEOUT_S)
    try:
        asyncio.run(move_once(receiver, sender))
        assert receiver.store.list_keys() == []
    finally:
        receiver.close(), sender.close()


def test_a_dropped_channel_that_never_opened_leaves_no_keys_in_the_store():
    receiver = TorchDistReceiver(timeout_s=1.0)
    channel = receiver.channel_for("prefill-that-never-comes")
    _wait_until(lambda: receiver.store.list_keys(), "the receiver never published its address")
    receiver.drop(channel)  # its build times out; then its keys go
    _wait_until(lambda: receiver.store.list_keys() == [], f"left in the store: {receiver.store.list_keys()}")
    receiver.close()


# --- item 6: gloo's address records carry none of the process's memory ---------------------------


class _Recording(dist.Store):
    """A store that keeps every value set through it."""

    def __init__(self, store: dist.Store) -> None:
        super().__init__()
        self.store, self.values = store, {}

    def set(self, key, value) -> None:
        self.values[key] = bytes(value)
        self.store.set(key, value)

    def get(self, key):
        return self.store.get(key)

    def wait(self, keys, timeout=None) -> None:
        self.store.wait(keys) if timeout is None else self.store.wait(keys, timeout)

    def add(self, key, amount):
        return self.store.add(key, amount)

    def check(self, keys):
        return self.store.check(keys)


def test_gloo_address_records_in_the_store_hold_no_uninitialised_memory():
    recording = _Recording(dist.HashStore())
    channel = ChannelSpec("127.0.0.1:1", "k", bytes(32))
    links = []

    def build(rank: int) -> None:
        link, _ = torch_dist._open(recording, channel, rank, gloo_device("127.0.0.1"), None, TIMEOUT_S)
        links.append(link)

    ranks = [threading.Thread(target=build, args=(rank,)) for rank in (0, 1)]
    [t.start() for t in ranks], [t.join() for t in ranks]
    assert len(links) == 2 and len(recording.values) == 2
    for key, record in recording.values.items():
        start = 8 + int.from_bytes(record[:8], "little") + 8  # after the hostname and the address length
        assert int.from_bytes(record[start - 8 : start], "little") == GLOO_ADDRESS_BYTES, key
        family = int.from_bytes(record[start : start + 2], "little")
        used = 16 if family == socket.AF_INET else 28
        padding = record[start + used : start + SOCKADDR_STORAGE_BYTES]
        assert padding == bytes(len(padding)), f"{key}: {padding.hex()}"  # was stack and libc addresses
    [link.shutdown() for link in links]


# --- the store, from another user --------------------------------------------------------------


# --- item 3: gloo's listener, from another user -------------------------------------------------
