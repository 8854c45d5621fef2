"""Scale-down without cutting a transfer: which workers the supervisor drains first, its kill timeout
above the longest drain a worker can take, and the worker's drain waiting for KV in flight past its
requests' deadline (in process: fake children, a fake servicer, an event loop on a virtual clock)."""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Callable
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


class VirtualClockLoop(asyncio.SelectorEventLoop):
    """An event loop whose clock stands still while anything is ready to run, and jumps to the next timer
    once everything waits: a drain's deadlines come in a few steps of the loop, however slow or busy the
    machine, and each read of the clock gives the same answer on every run."""

    def __init__(self) -> None:
        self._clock = _JumpingSelector()
        super().__init__(self._clock)

    def time(self) -> float:
        return self._clock.now


class _JumpingSelector(selectors.DefaultSelector):
    """Sleeps for no one: where the loop would wait for its next timer, the clock moves to it."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0

    def select(self, timeout: float | None = None) -> list:
        ready = super().select(0)
        if ready or timeout == 0:
            return ready
        if timeout is None:  # no timer: only another thread can wake the loop, as on a real clock
            return super().select(None)
        self.now += timeout
        return []


class FakeServicer:
    """What _drain reads of a WorkerServicer's engine core: open streams, KV landing (decode: asks,
    transfers and reservations, counted as awaiting KV), held prompts (prefill); and the loop times it
    read them at."""

    def __init__(self) -> None:
        self.draining = False
        self.num_streams = self.num_held = self.num_landing = 0
        self.looks: list[float] = []
        self.engine = SimpleNamespace(num_requests=self._num_requests, load=self._load)

    def _num_requests(self) -> int:
        self.looks.append(asyncio.get_running_loop().time())
        return self.num_streams

    def _load(self) -> SimpleNamespace:
        self.looks.append(asyncio.get_running_loop().time())
        return SimpleNamespace(num_held_requests=self.num_held, num_awaiting_kv=self.num_landing)

    def first_look_from(self, t: float) -> float | None:
        return min((look for look in self.looks if look >= t), default=None)


class FakeHealth:
    async def enter_graceful_shutdown(self) -> None:
        pass


def _drain_config() -> WorkerConfig:
    """Requests get 0.1 s; KV in flight up to the drain bound, 0.1 + 1.0 lease + 6 x 0.1 transfer = 1.7 s."""
    cache = CacheConfig(kv_lease_s=1.0)
    return WorkerConfig(engine=EngineConfig(cache=cache), drain_timeout_s=0.1, kv_transfer_timeout_s=0.1)


def _drain_on_virtual_clock(servicer: FakeServicer, moves: dict[float, Callable[[], None]]) -> float:
    """Drains from loop time 0, doing each of `moves` at its loop time; returns the loop time it ended
    at. A drain that ignores its deadlines fails here (a second past its bound) instead of hanging."""
    config = _drain_config()

    async def run() -> float:
        loop = asyncio.get_running_loop()
        for at, move in moves.items():
            loop.call_at(at, move)
        async with asyncio.timeout(config.drain_bound_s + 1.0):
            await server._drain(config, servicer, FakeHealth(), "w:1")
        return loop.time()

    with asyncio.Runner(loop_factory=VirtualClockLoop) as runner:
        return runner.run(run())


@pytest.mark.parametrize("moving", ["num_landing", "num_held"])
def test_a_drain_waits_past_the_request_deadline_for_kv_in_flight(moving):
    servicer = FakeServicer()
    setattr(servicer, moving, 1)
    lands_at = 0.27  # past drain_timeout_s, before the drain bound; off the drain's 50 ms looks (no tie)
    assert _drain_config().drain_timeout_s < lands_at < _drain_config().drain_bound_s
    ended = _drain_on_virtual_clock(servicer, {lands_at: lambda: setattr(servicer, moving, 0)})
    assert ended == servicer.first_look_from(lands_at)  # it stops once it sees the KV land


@pytest.mark.parametrize(
    "stuck, deadline",
    [
        pytest.param("num_streams", _drain_config().drain_timeout_s, id="request-never-ends"),
        pytest.param("num_landing", _drain_config().drain_bound_s, id="transfer-never-ends"),
        pytest.param("num_held", _drain_config().drain_bound_s, id="blocks-never-pulled"),
    ],
)
def test_a_drain_stops_at_its_deadlines(stuck, deadline):
    servicer = FakeServicer()
    setattr(servicer, stuck, 1)
    ended = _drain_on_virtual_clock(servicer, {})
    assert ended == servicer.first_look_from(deadline)  # waited until then, and no longer
