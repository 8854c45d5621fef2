"""Issue 35 items 3, 5 and 6: the KV plane against another local user. Each test is the attack; the
attackers run as user nobody where the machine allows it (tests/as_user.py, tests/kv_attacks.py).
A test marked xfail(strict=True) is an attack that still succeeds (NOT HELD in `make security-check`);
it fails loudly once someone fixes it, so the mark comes off with the fix. Workers run gloo and the
store in a KV agent process (services/disagg/transfer/isolated.py): the attacks that kill gloo or fill the
store end the agent, whose worker starts another, and fail the transfers on it (their requests
recompute); the victims here are agents."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from as_user import spawn_as_nobody

from splitserve.common.dist_store import gloo_device
from splitserve.services.disagg.transfer import torch_dist
from splitserve.services.disagg.transfer.base import ChannelSpec
from splitserve.services.disagg.transfer.isolated import AGENT_DATA_BYTES, AgentReceiver, AgentSender
from splitserve.services.disagg.transfer.torch_dist import TorchDistReceiver, TorchDistSender

SHAPE = (2, 2, 3, 4, 2, 8)  # [layers, K/V, blocks, block_size, kv_heads, head_dim]
TIMEOUT_S = 5.0
BOUND_S = 60.0  # an upper bound that only a broken run reaches
SOCKADDR_STORAGE_BYTES = 128  # Linux's; gloo's address record is one, then a u64 sequence number
GLOO_ADDRESS_BYTES = SOCKADDR_STORAGE_BYTES + 8


async def _transfer(receiver: TorchDistReceiver, sender: TorchDistSender) -> None:
    channel = receiver.channel_for("prefill-a")
    buffer, data = torch.zeros(SHAPE), torch.randn(SHAPE)
    tag = receiver.next_tag(channel)
    await asyncio.gather(receiver.recv(channel, tag, buffer), sender.send(channel, tag, data))
    assert torch.equal(buffer, data)


def _wait_until(done, what: str) -> None:
    deadline = time.monotonic() + BOUND_S
    while not done():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


# --- item 5: the store keeps no channel's keys --------------------------------------------------


@pytest.mark.unit
def test_a_built_channel_leaves_no_keys_in_the_store():
    receiver, sender = TorchDistReceiver(timeout_s=TIMEOUT_S), TorchDistSender(timeout_s=TIMEOUT_S)
    try:
        asyncio.run(_transfer(receiver, sender))
        assert receiver.store.list_keys() == []
    finally:
        receiver.close(), sender.close()


@pytest.mark.unit
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


@pytest.mark.unit
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






