"""`splitserve experiment CONFIG`: start each deployment (or reach a running OpenAI-compatible server),
warm it up, run every workload at every offered rate `repeats` times (then more rates, when the goodput
search asks for them), stop it; write a report folder: runs.json, PNG plots, summary.md. An autoscaled
deployment starts each run at the planner's minimum, and the planner sizes it while the run sends
(fleet.py); every run records its workers over time and its goodput per worker-second.

The config is described in config.py (examples in experiments/configs/). Each run is sized by time
([sweep] duration_s) or by count (a workload's num_requests); requests sent in its warm-up and cool-down
are sent but not counted (stats.Window). Repeats at one rate get fresh prompts and arrivals (a seed per
rate and repeat), the same ones for every deployment, so deployments see identical load. analysis.py
turns the runs into intervals over repeats and DistServe goodput; summary.py and plots.py report them.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path

from splitserve.experiments.analysis import analyze
from splitserve.experiments.config import Deployment, ExperimentConfig, Workloads, load_config
from splitserve.experiments.fleet import AutoscaledFleet, FixedFleet, Fleet, workers_used
from splitserve.experiments.goodput import search_goodput
from splitserve.experiments.loadgen import Connect, progress_bar, run_connected
from splitserve.experiments.stats import RequestRecord, attainment_samples, run_stats, summarize
from splitserve.experiments.workload import WorkloadConfig
from splitserve.services.launcher.launcher import Child, start_cluster, stop_cluster
from splitserve.services.launcher.supervisor import Supervisor

__all__ = ["Deployment", "ExperimentConfig", "load_config", "run_experiment", "run_experiment_file"]

# Send one workload to a started deployment: (records in send order, seconds from first send to last end).
Send = Callable[[WorkloadConfig, bool], tuple[list[RequestRecord], float]]


@dataclass(frozen=True, slots=True)
class Started:
    """A deployment ready for load: how to send to it, the core sets its workers are pinned to, and its
    workers over each run (None: the deployment's shape all along)."""

    send: Send
    cpu_sets: list[str] | None = None
    fleet: Fleet | None = None


Start = Callable[[ExperimentConfig, Deployment], AbstractContextManager[Started]]


def cpu_sets(num_workers: int) -> list[str]:
    """Disjoint core sets, one per worker (shared round robin when workers outnumber cores)."""
    cores = sorted(os.sched_getaffinity(0))
    per = max(1, len(cores) // num_workers)
    return [
        ",".join(map(str, cores[(i * per) % len(cores) : (i * per) % len(cores) + per])) for i in range(num_workers)
    ]


def _sender(connect: Connect) -> Send:
    def send(workload: WorkloadConfig, show_progress: bool) -> tuple[list[RequestRecord], float]:
        return asyncio.run(run_connected(connect, workload, progress_bar if show_progress else None))

    return send


@contextmanager
def start_deployment(cfg: ExperimentConfig, dep: Deployment) -> Iterator[Started]:
    """Start the deployment's cluster with the local launcher (nothing for an endpoint); stop it after."""
    if dep.endpoint is not None:
        yield Started(_sender(dep.connect(None)))
        return
    pinning = cpu_sets(dep.num_workers) if dep.pin_cpus else None
    children = start_cluster(
        dep.workers,
        list(cfg.engine_args),
        num_prefill=dep.prefill,
        num_decode=dep.decode,
        worker_argv=list(dep.worker_args),
        gateway_argv=list(dep.gateway_args),
        worker_cpus=pinning,
        devices=list(dep.devices) or None,
    )
    try:
        yield Started(_sender(dep.connect(children[0])), pinning, _autoscaled(cfg, dep, children))
    finally:
        stop_cluster(children)  # with the workers an autoscaled deployment's planner started (the same list)


def _autoscaled(cfg: ExperimentConfig, dep: Deployment, children: list[Child]) -> Fleet | None:
    """The planner's fleet over the started children, for an autoscaled deployment."""
    if dep.autoscale is None:
        return None
    argv = list(cfg.engine_args) + list(dep.worker_args)  # what start_cluster gave each worker
    supervisor = Supervisor(children, argv, "127.0.0.1", devices=list(dep.devices) or None)
    return AutoscaledFleet(supervisor, children[0], dep.autoscale)


def run_seed(base: int, rate: float, repeat: int) -> int:
    """A workload seed per (rate, repeat): fresh prompts for every run of a deployment (repeating them would
    turn later runs into prefix-cache hits), the same ones for every deployment (identical load).
    A string seed is hashed with SHA-512 by random, so this is the same in every process."""
    return random.Random(f"{base}/{rate!r}/{repeat}").randrange(2**31)


def sized(workload: WorkloadConfig, duration_s: float | None) -> WorkloadConfig:
    """The workload sized by time when a duration is set (its own, else [sweep] duration_s): Poisson and
    burst arrivals get enough requests that sending stops at the duration, not when they run out, so the
    arrivals are the process the rate promises over the whole run."""
    duration = workload.duration_s if workload.duration_s is not None else duration_s
    if duration is None or workload.arrival == "concurrency":
        return workload
    if workload.arrival not in ("poisson", "burst"):  # a trace: its rows, cut at the duration
        return replace(workload, duration_s=duration)
    per_arrival = workload.burst_size if workload.arrival == "burst" else 1
    expected = workload.rate * duration
    # A Poisson count exceeds its mean by 8 standard deviations (+8) with negligible probability.
    enough = math.ceil(expected + 8 * math.sqrt(expected) + 8) * per_arrival
    return replace(workload, duration_s=duration, num_requests=enough)


def planned_span(workload: WorkloadConfig) -> float | None:
    """The send span the measurement window is cut from: the duration for time-sized Poisson and burst
    runs, None (the last send) otherwise."""
    return workload.duration_s if workload.arrival in ("poisson", "burst") else None


@dataclass
class RateRuns:
    """One started deployment x one workload, run at offered rates `repeats` times each, once per rate:
    every SLO's goodput search reads the same runs."""

    cfg: ExperimentConfig
    dep: Deployment
    started: Started
    workload_name: str
    workload: WorkloadConfig
    by_rate: dict[float, list[dict]] = field(default_factory=dict)
    runs: list[dict] = field(default_factory=list)  # in the order they ran

    def ensure(self, rates: Sequence[float]) -> None:
        """Run the rates not run yet: repeat by repeat over all of them (not rate by rate), so a slow drift
        of the machine spreads over every rate instead of biasing one."""
        missing = [r for r in dict.fromkeys(rates) if r not in self.by_rate]
        for repeat in range(self.cfg.sweep.repeats):
            for rate in missing:
                run = self._run(rate, repeat)
                self.by_rate.setdefault(rate, []).append(run)
                self.runs.append(run)

    def attainment(self, rate: float, slo: str) -> list[float]:
        self.ensure([rate])
        return attainment_samples([run["stats"] for run in self.by_rate[rate]], slo)

    def _run(self, rate: float, repeat: int) -> dict:
        repeats = self.cfg.sweep.repeats
        print(f"[experiment] {self.dep.name} / {self.workload_name} / {rate} req/s / {repeat + 1} of {repeats}")
        seed = run_seed(self.workload.seed, rate, repeat)
        workload = sized(replace(self.workload, rate=rate, seed=seed), self.cfg.sweep.duration_s)
        fleet = self.started.fleet or FixedFleet(self.dep.tier_counts())
        with fleet.run() as fleet_run:
            records, seconds = self.started.send(workload, True)
            first_send = time.perf_counter() - seconds  # the load generator's clock starts at the first send
        stats = run_stats(records, rate, self.cfg.slos, self.cfg.sweep.window, planned_span(workload))
        workers, per_worker_second = workers_used(fleet_run.timeline(first_send), stats)
        return {
            "deployment": self.dep.name,
            "workload": self.workload_name,
            "rate": rate,
            "repeat": repeat,
            "seed": seed,
            "budget": self.dep.budget,
            "api": self.dep.protocol,
            "endpoint": self.dep.endpoint,
            "cpu_sets": self.started.cpu_sets,
            "duration_s": planned_span(workload),
            "summary": summarize(records, seconds).to_dict(),  # every record, no SLO: latencies as sent
            "stats": stats.to_dict(),  # the counted records: realised rate, attainment per SLO
            "goodput": {name: s.met_rate for name, s in stats.slos.items()},
            "workers": workers,  # live workers per tier over the run; worker-seconds and mean over the window
            "goodput_per_worker_second": per_worker_second,  # requests meeting the SLO / worker-seconds
            "planner": fleet_run.decisions,  # an autoscaled deployment's decision log (else None)
            "records": [asdict(r) for r in records],
        }


def warm_up(cfg: ExperimentConfig, started: Started, workloads: Workloads) -> None:
    """A few requests one at a time before anything is measured (first-call compilation, allocator growth)."""
    if not cfg.warmup_requests:
        return
    _, first = workloads[0]
    # A trace's first rows only (a trace sends all its rows, whatever num_requests says).
    rows = cfg.warmup_requests if first.trace is not None else first.trace_max_rows
    warmup = replace(
        first,
        num_requests=cfg.warmup_requests,
        arrival="concurrency",
        concurrency=1,
        duration_s=None,
        trace_max_rows=rows,
    )
    started.send(replace(warmup, seed=first.seed + 999_999), False)


def measure_deployment(cfg: ExperimentConfig, started: Started, dep: Deployment, workloads: Workloads) -> list[dict]:
    """Warm up, then for each workload: every grid rate, then the goodput search's extra rates per SLO."""
    warm_up(cfg, started, workloads)
    runs: list[dict] = []
    for name, workload in workloads:
        rate_runs = RateRuns(cfg, dep, started, name, workload)
        rate_runs.ensure(cfg.sweep.rates)
        for slo_name, slo in cfg.slos:
            # Run for the rates it makes run; analysis.py repeats the search over the recorded runs.
            probe = partial(rate_runs.attainment, slo=slo_name)
            search_goodput(probe, cfg.sweep.rates, slo.attainment, cfg.search, cfg.sweep.interval)
        runs += rate_runs.runs
    return runs


def run_experiment(cfg: ExperimentConfig, out: Path, start: Start = start_deployment) -> list[dict]:
    """Every planned deployment in turn; then runs.json (settings, runs, their analysis), plots, summary."""
    from splitserve.experiments.plots import write_plots
    from splitserve.experiments.summary import write_summary

    out.mkdir(parents=True, exist_ok=True)
    runs: list[dict] = []
    for dep, workloads in cfg.plan():
        with start(cfg, dep) as started:
            runs += measure_deployment(cfg, started, dep, workloads)
    analysis = analyze(runs, cfg)
    settings = {
        "config": cfg.settings,
        "cpus": sorted(os.sched_getaffinity(0)),
        "slos": {name: asdict(slo) for name, slo in cfg.slos},
        "sweep": asdict(cfg.sweep),
        "goodput_search": asdict(cfg.search),
    }
    report = {"settings": settings, "analysis": analysis.to_dict(), "runs": runs}
    (out / "runs.json").write_text(json.dumps(report, indent=1))
    write_plots(runs, analysis, cfg, out)
    write_summary(runs, analysis, cfg, out)
    return runs


def run_experiment_file(path: str, out: str | None) -> int:
    cfg = load_config(path)
    folder = Path(out) if out else Path("runs") / f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    run_experiment(cfg, folder)
    print(f"report: {folder}/summary.md (plots and runs.json beside it)")
    return 0
