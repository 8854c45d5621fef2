"""The planner's loop with scrapes made in process, a fake launcher (a real gRPC server in this process), and
its command line."""

from __future__ import annotations

import argparse
import io
import json
import threading
from concurrent import futures

import grpc
from prometheus_client import generate_latest

from splitserve.common.roles import Role
from splitserve.common.security import OPEN_CLUSTER
from splitserve.gateway.metrics import GatewayMetrics
from splitserve.protos.v1 import launcher_pb2 as pb
from splitserve.protos.v1 import launcher_pb2_grpc as pb_grpc
from splitserve.services.planner.capacity import SloTargets
from splitserve.services.planner.cli import add_planner_args, add_profile_args, planner_config_from_args
from splitserve.services.planner.loop import LauncherScaler, PlannerLoop
from splitserve.services.planner.metrics import PlannerMetrics
from splitserve.services.planner.policy import Bounds, Mode, PlannerConfig, TierBounds, make_policy
from splitserve.services.planner.reader import Samples, Scrape, WorkerScrape
from splitserve.services.worker.metrics import EngineSnapshot, WorkerMetrics

BOUNDS = Bounds({Role.PREFILL: TierBounds(1, 4), Role.DECODE: TierBounds(1, 4)}, budget=8)


class SlowTtft:
    """Scrapes of a 1P1D system whose every request takes 3 s to its first token."""

    def __init__(self) -> None:
        self.gateway, self.t = GatewayMetrics(), 0.0
        idle = EngineSnapshot(0, 0, 0.0, 0, 0, 0)
        self.workers = [WorkerMetrics("tiny", role.value, lambda: idle) for role in (Role.PREFILL, Role.DECODE)]
        self.fail_next = False

    def __call__(self) -> Scrape:
        if self.fail_next:
            self.fail_next = False
            raise OSError("connection refused")
        self.t += 10.0
        for _ in range(10):
            self.gateway.latency.ttft.observe(3.0)
        workers = tuple(
            WorkerScrape(f"w{i}", Role(m.labels["role"]), Samples.parse(generate_latest(m.registry).decode()))
            for i, m in enumerate(self.workers)
        )
        return Scrape(self.t, Samples.parse(generate_latest(self.gateway.registry).decode()), workers)


class Recorder:
    def __init__(self, release: threading.Event | None = None) -> None:
        self.calls: list[dict[Role, int]] = []
        self.release = release

    def scale(self, desired) -> str:
        self.calls.append(dict(desired))
        if self.release is not None:
            self.release.wait(5)
        return ", ".join(f"{n} {role.value}" for role, n in desired.items())


def make_loop(scaler=None, **kw):
    config = PlannerConfig(SloTargets(1.0, 0.05), BOUNDS, Mode.REACTIVE, up_intervals=1, up_cooldown_s=0, **kw)
    log = io.StringIO()
    return PlannerLoop(make_policy(config), SlowTtft(), PlannerMetrics(), log, scaler), log


def records(log: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in log.getvalue().splitlines()]


def test_the_loop_decides_logs_and_scales():
    scaler = Recorder()
    loop, log = make_loop(scaler)
    assert loop.step() is None  # one scrape: no rates yet
    decision = loop.step()
    assert decision is not None and decision.desired() == {Role.PREFILL: 2, Role.DECODE: 1}
    loop.wait_for_scale(5)
    assert scaler.calls == [{Role.PREFILL: 2, Role.DECODE: 1}]
    (logged, scaled) = records(log)
    assert logged["event"] == "decision" and logged["scale"] == "sent"
    assert logged["tiers"]["prefill"] == {"current": 1, "desired": 2, "action": "up", "reason": "ttft_over"}
    assert logged["observation"]["ttft_p90_s"] > 1.0
    assert scaled == {"event": "scaled", "shape": "2 prefill, 1 decode"}


def test_a_dry_run_only_logs_and_exports():
    loop, log = make_loop(None)
    loop.step()
    loop.step()
    assert records(log)[0]["scale"] == "dry_run"
    text = generate_latest(loop.metrics.registry).decode()
    assert 'splitserve_planner_desired_workers{tier="prefill"} 2.0' in text


def test_decisions_wait_while_a_scale_call_is_in_flight():
    release = threading.Event()
    scaler = Recorder(release)
    loop, log = make_loop(scaler)
    loop.step()
    loop.step()
    loop.step()  # the first call still blocks
    release.set()
    loop.wait_for_scale(5)
    assert len(scaler.calls) == 1
    assert [r.get("scale") for r in records(log)] == ["sent", "in_flight", None]


def test_a_failed_scrape_is_logged_and_skipped():
    loop, log = make_loop(None)
    loop.step()
    loop.scrape.fail_next = True  # type: ignore[attr-defined]
    assert loop.step() is None
    assert loop.step() is not None
    assert records(log)[0]["event"] == "scrape_failed"


class FakeLauncher(pb_grpc.LauncherServicer):
    def __init__(self) -> None:
        self.requests: list[pb.ScaleRequest] = []

    def Scale(self, request, context):
        self.requests.append(request)
        return pb.ScaleResponse(shape=f"0 unified, {request.num_prefill} prefill, {request.num_decode} decode")


def test_launcher_scaler_sends_the_planned_tiers_only():
    launcher = FakeLauncher()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    pb_grpc.add_LauncherServicer_to_server(launcher, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        shape = LauncherScaler(f"127.0.0.1:{port}", OPEN_CLUSTER).scale({Role.PREFILL: 3, Role.DECODE: 2})
    finally:
        server.stop(None)
    assert shape == "0 unified, 3 prefill, 2 decode"
    (request,) = launcher.requests
    assert request.HasField("num_prefill") and request.HasField("num_decode")
    assert not request.HasField("num_unified")


def test_command_line():
    parser = argparse.ArgumentParser(prog="splitserve")
    sub = parser.add_subparsers(dest="command")
    add_planner_args(sub)
    add_profile_args(sub)
    args = parser.parse_args(
        ["planner", "--gateway-metrics", "h:9", "--ttft-ms", "800", "--itl-ms", "50", "--max-prefill", "3"]
    )
    config = planner_config_from_args(args)
    assert config.targets == SloTargets(0.8, 0.05) and config.mode is Mode.REACTIVE
    assert config.bounds.tiers[Role.PREFILL] == TierBounds(1, 3)
    colocated = parser.parse_args(
        ["planner", "--gateway-metrics", "h:9", "--ttft-ms", "1", "--itl-ms", "1", "--colocated", "--budget", "4"]
    )
    assert tuple(planner_config_from_args(colocated).bounds.tiers) == (Role.UNIFIED,)
    profile = parser.parse_args(["profile", "--prefill-lens", "64,256", "--max-num-seqs", "8"])
    assert profile.func.__name__ == "run_profile" and profile.max_num_seqs == 8
