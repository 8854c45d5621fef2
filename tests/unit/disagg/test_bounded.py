"""Tables keyed by what clients and peers send stay bounded: the recent-entries map itself, the
prefix-affinity router's owner table and the KV sender's failed-channel keys."""

from __future__ import annotations

import asyncio
import socket

import pytest
import torch

from splitserve.common.bounded import RecentMap
from splitserve.gateway.router import PrefixAffinityRouter, RouteInput
from splitserve.gateway.workers import WorkerHandle
from splitserve.services.disagg.transfer.base import ChannelSpec, TransferError, TransferFailure
from splitserve.services.disagg.transfer.torch_dist import TorchDistSender


def test_recent_map_keeps_the_newest_entries():
    recent: RecentMap[str, int] = RecentMap(2)
    recent.set("a", 1)
    recent.set("b", 2)
    assert recent.get("a") == 1  # a is now newer than b
    recent.set("c", 3)
    assert "a" in recent and "b" not in recent and "c" in recent and len(recent) == 2
    with pytest.raises(ValueError):
        RecentMap(0)


def _worker(address: str) -> WorkerHandle:
    return WorkerHandle("w", address, None, "m", 0, "", 0, None, None)  # type: ignore[arg-type]  # never called


def test_prefix_affinity_owner_table_is_bounded_and_keeps_recent_prompts_sticky():
    router = PrefixAffinityRouter(max_prompts=64)
    workers = [_worker(f"127.0.0.1:{port}") for port in (1, 2, 3)]

    def pick(first: int) -> str:
        route = RouteInput(prompt_token_ids=[first] * 16, num_prompt_blocks=1)
        decision = router.pick(workers, route, "prefill")
        assert decision is not None
        return decision.worker.address

    sticky = pick(0)
    for first in range(1, 10_000):
        pick(first)
        assert pick(0) == sticky  # a prompt in use keeps its worker
    assert router.num_prompts() <= 64


def test_kv_sender_remembers_a_bounded_number_of_failed_channels():
    """Failed channels are refused as closed; past the bound the oldest is forgotten (a send on it
    would try to connect again, and fail again: its receiver dropped it)."""
    sender = TorchDistSender(timeout_s=0.2, max_failed_channels=2)
    nobody = f"127.0.0.1:{_free_port()}"  # a rendezvous where no store listens

    async def reason(key: str) -> TransferFailure:
        with pytest.raises(TransferError) as failed:
            await sender.send(ChannelSpec(nobody, key, b"s" * 32), 1, torch.zeros(1, 4))
        return failed.value.reason

    async def run() -> list[TransferFailure]:
        first = [await reason(key) for key in ("c1", "c2", "c3")]  # each fails to connect
        return first + [await reason("c3"), await reason("c1")]

    assert asyncio.run(run()) == [TransferFailure.CONNECT] * 3 + [TransferFailure.CLOSED, TransferFailure.CONNECT]
    sender.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
