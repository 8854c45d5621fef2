"""Scale-down without cutting a transfer: which workers the supervisor drains first, its kill timeout
above the longest drain a worker can take, and the worker's drain waiting for KV in flight past its
requests' deadline (in process: fake children, a fake servicer)."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from splitserve.protos.v1 import worker_pb2 as wpb
from splitserve.services.engine.config import CacheConfig, EngineConfig
from splitserve.services.launcher import supervisor as supervisor_module
from splitserve.services.launcher.launcher import Child
from splitserve.services.launcher.supervisor import EXIT_GRACE_S, Supervisor, drain_order
from splitserve.services.worker import server
from splitserve.services.worker.server import WorkerConfig


class FakeProc:
    returncode = None

    def poll(self) -> None:
        return None


def _child(name: str, mode: str) -> Child:
    return Child(name, f"{name}:1", f"{name}:2", FakeProc(), mode)


def test_drain_order_prefers_silent_then_idle_then_least_loaded_and_newest():
    loads = [
        wpb.LoadReport(),  # 0: idle
        wpb.LoadReport(num_running=1, num_awaiting_kv=1),  # 1: a transfer landing
        None,  # 2: did not answer
        wpb.LoadReport(num_running=3, num_waiting=1),  # 3: busy, nothing in flight
        wpb.LoadReport(),  # 4: idle, newer than 0
        wpb.LoadReport(num_held_requests=1, num_held_blocks=4),  # 5: blocks a decode worker will pull
        wpb.LoadReport(num_running=1),  # 6
    ]
    assert drain_order(loads) == [2, 4, 0, 6, 3, 5, 1]
    assert drain_order([]) == []


def test_scale_down_drains_the_workers_drain_order_picks(monkeypatch):
    gateway = _child("gateway", "gateway")
    decodes = [_child(f"decode-{i}", "decode") for i in range(3)]
    loads = {
        "decode-0:1": wpb.LoadReport(num_running=2),
        "decode-1:1": wpb.LoadReport(num_awaiting_kv=1),
        "decode-2:1": wpb.LoadReport(num_running=4),
    }
    sup = Supervisor([gateway, *decodes], ["--model", "m"], "127.0.0.1")
    monkeypatch.setattr(sup, "_load", lambda child: loads[child.address])
    drained: list[list[str]] = []
    monkeypatch.setattr(sup, "_drain", lambda victims: drained.append([c.name for c in victims]) or victims)
    sup.scale({"decode": 1})
    assert drained == [["decode-0", "decode-2"]]  # decode-1 keeps its transfer


@pytest.mark.parametrize(
    "argv, lease_s, transfer_s",
    [([], 30.0, 30.0), (["--kv-lease-s", "5", "--kv-transfer-timeout", "2", "--model", "m"], 5.0, 2.0)],
)
def test_the_supervisor_waits_longer_than_a_worker_can_drain(argv, lease_s, transfer_s):
    sup = Supervisor([_child("gateway", "gateway")], argv, "127.0.0.1")
    worker = WorkerConfig(engine=EngineConfig(cache=CacheConfig(kv_lease_s=lease_s)), kv_transfer_timeout_s=transfer_s)
    assert sup.drain_timeout_s == worker.drain_bound_s + EXIT_GRACE_S
    assert Supervisor([_child("gateway", "gateway")], argv, "h", drain_timeout_s=7.0).drain_timeout_s == 7.0
    assert supervisor_module.worker_drain_bound_s(argv) == worker.drain_bound_s


class FakeServicer:
    """What _drain reads of a WorkerServicer's engine core: open streams, KV landing (decode: asks,
    transfers and reservations, counted as awaiting KV), held prompts (prefill)."""

    def __init__(self) -> None:
        self.draining = False
        self.num_streams = self.num_held = self.num_landing = 0
        load = lambda: SimpleNamespace(num_held_requests=self.num_held, num_awaiting_kv=self.num_landing)  # noqa: E731
        self.engine = SimpleNamespace(num_requests=lambda: self.num_streams, load=load)


class FakeHealth:
    async def enter_graceful_shutdown(self) -> None:
        pass


def _drain_config() -> WorkerConfig:
    """Requests get 0.1 s; KV in flight up to the drain bound, 0.1 + 1.0 lease + 6 x 0.1 transfer = 1.7 s."""
    cache = CacheConfig(kv_lease_s=1.0)
    return WorkerConfig(engine=EngineConfig(cache=cache), drain_timeout_s=0.1, kv_transfer_timeout_s=0.1)


def test_a_drain_waits_past_the_request_deadline_for_kv_in_flight():
    async def run() -> list[str]:
        servicer, events = FakeServicer(), []
        servicer.num_landing = 1
        servicer.num_held = 1
        drain = asyncio.create_task(server._drain(_drain_config(), servicer, FakeHealth(), "w:1"))
        await asyncio.sleep(0.25)  # past drain_timeout_s
        events.append(f"landing: done={drain.done()}")
        servicer.num_landing = 0
        await asyncio.sleep(0.1)
        events.append(f"held: done={drain.done()}")
        servicer.num_held = 0
        await asyncio.wait_for(drain, 0.3)
        return events

    assert asyncio.run(run()) == ["landing: done=False", "held: done=False"]


def test_a_drain_stops_at_its_deadlines():
    async def run(servicer: FakeServicer) -> float:
        start = time.monotonic()
        await server._drain(_drain_config(), servicer, FakeHealth(), "w:1")
        return time.monotonic() - start

    streaming = FakeServicer()
    streaming.num_streams = 1  # a request that never ends: cut at drain_timeout_s
    assert 0.1 <= asyncio.run(run(streaming)) < 1.0
    stuck = FakeServicer()
    stuck.num_landing = 1  # a transfer that never ends: cut at the drain bound
    assert 1.7 <= asyncio.run(run(stuck)) < 3.0
