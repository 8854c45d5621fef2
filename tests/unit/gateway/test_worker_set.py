"""The gateway forgets a worker that stays unhealthy past a bound (it died without deregistering:
SIGKILL, OOM, a crash): its handle, channel and health checks go, and so do its prefix-index entries;
one that recovers before the bound is kept. Health checks here are real gRPC calls to an address
where nothing listens."""

from __future__ import annotations

import asyncio
import socket

from splitserve.gateway.workers import WorkerSet
from splitserve.protos.v1 import worker_pb2 as pb


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _dead_address() -> str:
    """A port that was free a moment ago: connections to it are refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def test_a_worker_unhealthy_past_the_bound_is_forgotten_with_its_index_entries():
    clock, forgotten = Clock(), []

    async def on_forgotten(address: str) -> None:
        forgotten.append(address)

    async def run() -> list[list[str]]:
        workers = WorkerSet(check_timeout_s=5.0, forget_after_s=30.0, clock=clock)
        address = _dead_address()
        workers.add(pb.RegisterWorkerRequest(address=address, model="m"))
        seen = []
        for advance in (0.0, 1.0, 29.0, 1.0):  # unhealthy at the 2nd failure (t=1); forgotten at t=31
            clock.now += advance
            await workers.check_all(on_forgotten)
            seen.append([w.address for w in workers.all()])
        await workers.close()
        return seen

    seen = asyncio.run(run())
    assert [bool(s) for s in seen] == [True, True, True, False]
    assert len(forgotten) == 1 and forgotten[0] == seen[0][0]


def test_a_worker_that_recovers_before_the_bound_is_kept():
    clock = Clock()

    async def never(address: str) -> None:
        raise AssertionError(f"{address} was forgotten")

    async def run() -> bool:
        workers = WorkerSet(check_timeout_s=5.0, forget_after_s=30.0, clock=clock)
        handle = workers.add(pb.RegisterWorkerRequest(address=_dead_address(), model="m"))
        for _ in range(2):
            clock.now += 20.0
            await workers.check_all(never)
        assert not handle.healthy
        workers.mark_healthy(handle)  # what a passing check does
        clock.now += 20.0  # 60 s after the first failure, but only 20 s after it recovered
        workers.mark_failed(handle)
        await workers.check_all(never)
        kept = workers.get(handle.address) is handle
        await workers.close()
        return kept

    assert asyncio.run(run())
