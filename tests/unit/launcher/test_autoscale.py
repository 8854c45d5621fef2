"""The planner in process, without processes: `up --autoscale`'s flags into the planner's config, the
Supervisor scaler's tiers as modes, an experiment's autoscale table, worker timelines and goodput per
worker-second on synthetic records with known answers, and a whole experiment with a fake autoscaled
deployment through its report."""

from __future__ import annotations

import json
import random
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from splitserve.common.roles import Role
from splitserve.experiments.analysis import analyze
from splitserve.experiments.config import Deployment, ExperimentConfig, load_config
from splitserve.experiments.experiment import Started, run_experiment
from splitserve.experiments.fleet import AutoscaledFleet, FleetRun, WorkerTimeline, workers_used
from splitserve.experiments.stats import SLO, RequestRecord, Window, run_stats
from splitserve.experiments.workload import WorkloadConfig, arrival_offsets
from splitserve.services.launcher.autoscale import AutoscaleSettings, SupervisorScaler
from splitserve.services.launcher.cli import build_parser
from splitserve.services.launcher.launcher import Child, _up_planner
from splitserve.services.planner.capacity import SloTargets
from splitserve.services.planner.cli import policy_args_from_table
from splitserve.services.planner.loop import ScaleFailed
from splitserve.services.planner.policy import Mode, TierBounds


def _up(*argv: str):
    args, extra = build_parser().parse_known_args(["up", *argv])
    return args, extra


# --- `up --autoscale`


def test_up_takes_the_planners_options_and_plans_the_tiers_it_starts():
    args, extra = _up(
        "--prefill", "1", "--decode", "2", "--autoscale", "--ttft-ms", "800", "--itl-ms", "50",
        "--max-prefill", "3", "--budget", "5", "--interval-s", "2", "--secrets-dir", "state",
        "--max-num-seqs", "8",
    )  # fmt: skip
    assert extra == ["--max-num-seqs", "8"]  # an engine flag still goes to the workers
    planner = _up_planner(args)
    config = planner.settings.config
    assert config.targets == SloTargets(0.8, 0.05) and config.mode is Mode.REACTIVE
    assert dict(config.bounds.tiers) == {Role.PREFILL: TierBounds(1, 3), Role.DECODE: TierBounds(1, 8)}
    assert config.bounds.budget == 5 and planner.settings.interval_s == 2.0 and not planner.settings.dry_run
    assert planner.log_path == Path("state") / "planner-decisions.jsonl" and planner.metrics_port == 0


def test_up_with_unified_workers_plans_a_unified_tier():
    args, _ = _up("--workers", "2", "--autoscale", "--ttft-ms", "1", "--itl-ms", "1", "--planner-log", "-")
    planner = _up_planner(args)
    assert tuple(planner.settings.config.bounds.tiers) == (Role.UNIFIED,)
    assert planner.log_path is None  # stderr


def test_up_autoscale_needs_targets_and_a_consistent_shape():
    with pytest.raises(ValueError, match="--ttft-ms and --itl-ms"):
        _up_planner(_up("--autoscale", "--ttft-ms", "500")[0])
    with pytest.raises(ValueError, match="--colocated plans unified workers"):
        _up_planner(
            _up("--prefill", "1", "--decode", "1", "--autoscale", "--colocated", "--ttft-ms", "1", "--itl-ms", "1")[0]
        )
    with pytest.raises(ValueError, match="performance profile"):
        _up_planner(_up("--autoscale", "--ttft-ms", "1", "--itl-ms", "1", "--mode", "predictive")[0])
    args, _ = _up("--workers", "1")
    assert not args.autoscale and args.ttft_ms is None  # the planner's options are optional without it


class FakeSupervisor:
    """Live workers per mode; scale() sets them (or fails as the Supervisor does)."""

    def __init__(self, **alive: int) -> None:
        self.alive = dict(alive)
        self.calls: list[dict[str, int]] = []
        self.fail: Exception | None = None

    def scale(self, wanted: dict[str, int]) -> tuple[list, list]:
        self.calls.append(dict(wanted))
        if self.fail is not None:
            raise self.fail
        self.alive |= wanted
        return [], []

    def shape(self) -> str:
        return ", ".join(f"{n} {mode}" for mode, n in self.alive.items())

    def workers(self, mode: str) -> list[Child]:
        return [None] * self.alive.get(mode, 0)  # type: ignore[list-item]  # only counted


def test_the_supervisor_scaler_asks_for_modes_and_reports_the_shape():
    supervisor = FakeSupervisor(prefill=1, decode=1)
    shape = SupervisorScaler(supervisor).scale({Role.PREFILL: 2, Role.DECODE: 1})
    assert supervisor.calls == [{"prefill": 2, "decode": 1}] and shape == "2 prefill, 1 decode"
    supervisor.fail = TimeoutError("prefill-2 was not healthy within 180 s")
    with pytest.raises(ScaleFailed, match="UNAVAILABLE: a new worker did not come up: prefill-2"):
        SupervisorScaler(supervisor).scale({Role.PREFILL: 3})
    supervisor.fail = ValueError("prefill workers need at least one decode worker")
    with pytest.raises(ScaleFailed, match="INVALID_ARGUMENT"):
        SupervisorScaler(supervisor).scale({Role.DECODE: 0})


# --- an experiment's autoscale table


def test_the_autoscale_table_takes_the_planners_flags():
    a = policy_args_from_table({"ttft_ms": 800, "itl_ms": 50, "max_prefill": 3, "dry_run": True, "colocated": False})
    assert (a.ttft_ms, a.max_prefill, a.dry_run, a.colocated, a.budget) == (800.0, 3, True, False, 16)
    with pytest.raises(ValueError, match="unknown option 'max_prefil'"):
        policy_args_from_table({"ttft_ms": 1, "itl_ms": 1, "max_prefil": 3})
    with pytest.raises(ValueError, match="invalid choice"):
        policy_args_from_table({"ttft_ms": 1, "itl_ms": 1, "mode": "psychic"})
    with pytest.raises(ValueError, match="ttft_ms and itl_ms"):
        policy_args_from_table({"ttft_ms": 1})


def _config(tmp_path: Path, deployment: str) -> Path:
    path = tmp_path / "c.toml"
    path.write_text(f"""
name = "c"
[[deployments]]
name = "planner"
{deployment}
[sweep]
rates = [1.0]
[[workloads]]
name = "w"
""")
    return path


def test_an_autoscaled_deployment_starts_at_the_planners_minimum(tmp_path):
    table = "[deployments.autoscale]\nttft_ms = 3000\nitl_ms = 200\nmin_decode = 2\nmax_prefill = 2\nbudget = 4"
    (dep,) = load_config(_config(tmp_path, table)).deployments
    assert (dep.workers, dep.prefill, dep.decode, dep.budget) == (0, 1, 2, 4)
    assert dep.autoscale is not None and dep.autoscale.config.targets == SloTargets(3.0, 0.2)
    colocated = "[deployments.autoscale]\nttft_ms = 1\nitl_ms = 1\ncolocated = true\nmin_workers = 2"
    (dep,) = load_config(_config(tmp_path, colocated)).deployments
    assert dep.tier_counts() == {"unified": 2}
    with pytest.raises(ValueError, match="leave out workers, prefill and decode"):
        load_config(_config(tmp_path, "prefill = 1\ndecode = 1\n" + table))
    with pytest.raises(ValueError, match="unpinned"):
        load_config(_config(tmp_path, "pin_cpus = true\n" + table))
    with pytest.raises(ValueError, match=r"c\.toml: .*minimums exceed the budget"):
        load_config(_config(tmp_path, table.replace("budget = 4", "budget = 2")))


# --- worker timelines and goodput per worker-second


# 2 workers until 10 s, 3 until 30 s, 2 after (the first count also holds before 0)
STEP = WorkerTimeline(
    ((0.0, {"prefill": 1, "decode": 1}), (10.0, {"prefill": 2, "decode": 1}), (30.0, {"prefill": 1, "decode": 1}))
)


def test_worker_seconds_integrate_the_step_function():
    timeline = STEP
    assert timeline.worker_seconds(5.0, 35.0) == pytest.approx(2 * 5 + 3 * 20 + 2 * 5)
    assert timeline.worker_seconds(-4.0, 2.0) == pytest.approx(12.0)
    assert timeline.worker_seconds(12.0, 12.0) == 0.0
    assert timeline.tiers() == ["prefill", "decode"]
    with pytest.raises(ValueError):
        WorkerTimeline(((1.0, {"unified": 1}), (0.0, {"unified": 2})))


def test_a_fleet_runs_samples_become_a_compact_timeline_from_the_first_send():
    origin = 100.0
    samples = [(99.0, {"decode": 1}), (99.5, {"decode": 1}), (101.0, {"decode": 1}), (102.0, {"decode": 2})]
    samples += [(103.0, {"decode": 2}), (104.0, {"decode": 2})]
    timeline = FleetRun(samples).timeline(origin)
    assert timeline.to_json() == [[0.0, {"decode": 1}], [2.0, {"decode": 2}], [4.0, {"decode": 2}]]
    assert WorkerTimeline.from_json(timeline.to_json()) == timeline


def _record(start_s: float, ttft_s: float) -> RequestRecord:
    times = [ttft_s, ttft_s + 0.05, ttft_s + 0.1]
    return RequestRecord(10, 3, ttft_s=ttft_s, token_times_s=times, e2e_s=times[-1], start_s=start_s)


def test_goodput_per_worker_second_divides_met_requests_by_the_worker_integral():
    # Sends every second for 40 s; those at 5 ... 35 s are counted (31); the ones from 20 s on miss TTFT.
    records = [_record(float(t), 0.1 if t < 20 else 2.0) for t in range(40)]
    stats = run_stats(records, 1.0, [("slo", SLO(ttft_ms=500))], Window(5.0, 5.0), planned_s=40.0)
    assert stats.slos["slo"].num_met == 15  # 5 ... 19 s
    timeline = STEP
    used, per_worker_second = workers_used(timeline, stats)
    assert used["worker_seconds"] == pytest.approx(80.0) and used["mean"] == pytest.approx(80.0 / 30.0)
    assert per_worker_second == {"slo": pytest.approx(15 / 80.0)}
    fixed = WorkerTimeline(((0.0, {"prefill": 1, "decode": 1}),))
    _, fixed_rate = workers_used(fixed, stats)  # a fixed layout: goodput per worker
    assert fixed_rate["slo"] == pytest.approx(stats.slos["slo"].met_rate / 2)


def test_an_autoscaled_fleet_starts_each_run_at_the_minimum_and_samples_its_workers():
    supervisor = FakeSupervisor(prefill=2, decode=1)
    settings = AutoscaleSettings.from_args(policy_args_from_table({"ttft_ms": 1, "itl_ms": 1, "interval_s": 600}))
    gateway = Child("gateway", "127.0.0.1:1", "127.0.0.1:1", proc=None)  # type: ignore[arg-type]  # nothing there
    fleet = AutoscaledFleet(supervisor, gateway, settings, sample_s=0.02)
    with fleet.run() as used:
        start = time.perf_counter()
        time.sleep(0.1)
        supervisor.alive["prefill"] = 2  # as if the planner had scaled
        time.sleep(0.1)
    assert supervisor.calls == [{"prefill": 1, "decode": 1}]  # reset to the minimum first
    timeline = used.timeline(start)
    assert timeline.samples[0] == (0.0, {"prefill": 1, "decode": 1}) and timeline.samples[-1][1]["prefill"] == 2
    assert 0.09 < timeline.samples[1][0] < 0.2
    assert used.decisions is not None and used.decisions[0]["event"] == "scrape_failed"  # nothing listening


# --- a whole experiment: fixed layouts and a (fake) autoscaled one


class FakeAutoscaled:
    """Samples as a planner would leave them: 2 workers, 3 from 10 s to 30 s of each run, 2 after."""

    @contextmanager
    def run(self):
        used = FleetRun()
        yield used
        first_send = time.perf_counter() - 40.0  # the fake send says it took 40 s
        for t, prefill in ((-1.0, 1), (10.0, 2), (30.0, 1), (41.0, 1)):
            used.samples.append((first_send + t, {"prefill": prefill, "decode": 1}))
        used.decisions = [{"event": "decision"}]


def _fake_start(cfg: ExperimentConfig, dep: Deployment):
    """Every request meets the SLO, sent on the workload's Poisson arrivals over 40 s."""

    @contextmanager
    def started():
        def send(w: WorkloadConfig, show_progress: bool):
            rng = random.Random(w.seed)
            offsets = [t for t in arrival_offsets(w, w.num_requests) or [] if t < 40.0]
            return [_record(t, 0.1 * rng.uniform(0.5, 1.0)) for t in offsets], 40.0

        yield Started(send, fleet=FakeAutoscaled() if dep.autoscale else None)

    return started()


def test_an_experiment_compares_fixed_layouts_with_the_planner(tmp_path):
    config = tmp_path / "fake.toml"
    config.write_text("""
name = "fake"
warmup_requests = 0
[[slos]]
name = "ok"
ttft_ms = 500
[[deployments]]
name = "1P1D"
prefill = 1
decode = 1
[[deployments]]
name = "planner"
[deployments.autoscale]
ttft_ms = 500
itl_ms = 100
max_prefill = 2
budget = 3
[sweep]
rates = [1.0, 2.0]
repeats = 2
duration_s = 40
warmup_s = 5
cooldown_s = 5
[[workloads]]
name = "chat"
""")
    cfg = load_config(config)
    out = tmp_path / "report"
    runs = run_experiment(cfg, out, start=_fake_start)
    for r in runs:
        met = r["stats"]["slos"]["ok"]["num_met"]
        assert met == r["stats"]["num_counted"] > 0
        worker_seconds = 2 * 30.0 if r["deployment"] == "1P1D" else 2 * 5 + 3 * 20 + 2 * 5
        assert r["workers"]["worker_seconds"] == pytest.approx(worker_seconds, rel=1e-3)
        assert r["goodput_per_worker_second"]["ok"] == pytest.approx(met / worker_seconds, rel=1e-3)
        assert (r["planner"] is None) == (r["deployment"] == "1P1D")
    fixed = next(r for r in runs if r["deployment"] == "1P1D")
    assert fixed["workers"]["timeline"] == [[0.0, {"prefill": 1, "decode": 1}]]
    assert fixed["goodput_per_worker_second"]["ok"] == pytest.approx(fixed["goodput"]["ok"] / 2)
    saved = json.loads((out / "runs.json").read_text())
    points = {(p["deployment"], p["rate"]): p for p in saved["analysis"]["points"]}
    assert points[("planner", 1.0)]["mean_workers"]["mean"] == pytest.approx(80 / 30, rel=1e-3)
    assert points[("1P1D", 2.0)]["mean_workers"]["mean"] == 2.0
    assert json.loads(json.dumps(analyze(saved["runs"], cfg).to_dict())) == saved["analysis"]  # runs.json rebuilds it
    assert (out / "chat-workers_over_time.png").read_bytes()[:4] == b"\x89PNG"
    summary = (out / "summary.md").read_text()
    assert "### Fixed layouts vs the planner, SLO `ok`" in summary and "| planner | 1 | 2.67" in summary
    assert "| planner | <= 3 (planner) |" in summary
