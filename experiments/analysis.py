"""From an experiment's runs to what its report says.

- A Point per deployment x workload x offered rate: over its repeats, intervals of the realised rate,
  of the workers it ran on (mean over the window) and, per SLO, of the attainment (TTFT alone, TPOT
  alone, both), of goodput per worker (requests meeting the SLO per second of the measurement window,
  divided by the deployment's workers or GPUs) and of goodput per worker-second (the same requests
  divided by the integral of its live workers over the window: what an autoscaled deployment is
  compared by; for a fixed layout, goodput per worker).
- A Knee per deployment x workload x SLO: DistServe's goodput, by running goodput.search_goodput again
  over the recorded runs (the same inputs give the same probes, so it is the search the experiment ran).
- compare(): the best of several, and every one whose interval overlaps it; a winner is named only
  when that group is one deployment.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import TypeVar

from splitserve.experiments.config import ExperimentConfig
from splitserve.experiments.goodput import GoodputResult, search_goodput
from splitserve.experiments.intervals import Interval, interval, overlaps
from splitserve.experiments.stats import attainment_samples

T = TypeVar("T")
ATTAINMENT = (0.0, 1.0)  # attainment intervals are clipped to what a share can be
RATE = (0.0, math.inf)  # and intervals of rates (requests / s, workers) to what a rate can be


@dataclass(frozen=True, slots=True)
class PointSLO:
    ttft: Interval  # attainment of the TTFT objective alone
    tpot: Interval
    both: Interval  # the SLO attainment
    goodput_per_worker: Interval  # requests meeting the SLO / window second / worker
    goodput_per_worker_second: Interval  # requests meeting the SLO / worker-seconds used in the window
    passed: bool  # mean attainment >= the SLO's target


@dataclass(frozen=True, slots=True)
class Point:
    """One deployment x workload x offered rate, over its repeats."""

    deployment: str
    workload: str
    rate: float  # offered requests / s
    budget: int  # workers (or GPUs) goodput per worker divides by
    realised_rate: Interval  # counted requests / window second
    mean_workers: Interval  # live workers, averaged over the window
    num_sent: int  # over all repeats
    num_counted: int
    slos: dict[str, PointSLO]


@dataclass(frozen=True, slots=True)
class Knee:
    """DistServe's goodput of one deployment x workload x SLO."""

    deployment: str
    workload: str
    slo: str
    budget: int
    result: GoodputResult

    @property
    def per_worker(self) -> GoodputResult:
        return self.result.per_worker(self.budget)


@dataclass(frozen=True, slots=True)
class Analysis:
    points: tuple[Point, ...]
    knees: tuple[Knee, ...]
    interval: str  # the interval method: "t" or "bootstrap"

    def workloads(self) -> list[str]:
        return list(dict.fromkeys(p.workload for p in self.points))

    def points_of(self, workload: str) -> list[Point]:
        return [p for p in self.points if p.workload == workload]

    def knees_of(self, workload: str, slo: str) -> list[Knee]:
        return [k for k in self.knees if k.workload == workload and k.slo == slo]

    def knee(self, deployment: str, workload: str, slo: str) -> Knee | None:
        return next((k for k in self.knees_of(workload, slo) if k.deployment == deployment), None)

    def to_dict(self) -> dict:
        out = asdict(self)
        for knee, saved in zip(self.knees, out["knees"]):
            per_worker = asdict(knee.per_worker)
            saved["per_worker"] = {k: v for k, v in per_worker.items() if k != "probes"}  # probes: in "result"
        return out


def _grouped(runs: Sequence[dict]) -> dict[tuple[str, str], dict[float, list[dict]]]:
    """(deployment, workload) -> offered rate -> its repeats, in the order they ran."""
    groups: dict[tuple[str, str], dict[float, list[dict]]] = {}
    for run in runs:
        groups.setdefault((run["deployment"], run["workload"]), {}).setdefault(run["rate"], []).append(run)
    return groups


def point(repeats: Sequence[dict], slos: Sequence[tuple[str, float]], method: str) -> Point:
    """slos: (name, attainment target) pairs."""
    first, stats = repeats[0], [r["stats"] for r in repeats]
    budget = first["budget"]

    def over(get: Callable[[dict], float]) -> Interval:
        return interval([get(s) for s in stats], method, RATE)

    def over_runs(get: Callable[[dict], float]) -> Interval:
        return interval([get(r) for r in repeats], method, RATE)

    def share(name: str, key: str) -> Interval:
        return interval(attainment_samples(stats, name, key), method, ATTAINMENT)

    def per_slo(name: str, target: float) -> PointSLO:
        both = share(name, "both")
        return PointSLO(
            share(name, "ttft"),
            share(name, "tpot"),
            both,
            over(lambda s: s["slos"][name]["met_rate"] / budget),
            over_runs(lambda r: _per_worker_second(r, name)),
            both.mean >= target,
        )

    return Point(
        first["deployment"],
        first["workload"],
        first["rate"],
        budget,
        over(lambda s: s["realised_rate"]),
        over_runs(lambda r: r["workers"]["mean"] if "workers" in r else r["budget"]),
        sum(s["num_sent"] for s in stats),
        sum(s["num_counted"] for s in stats),
        {name: per_slo(name, target) for name, target in slos},
    )


def _per_worker_second(run: dict, slo: str) -> float:
    """Goodput per worker-second of one run (a runs.json from before worker timelines: per worker)."""
    if "goodput_per_worker_second" in run:
        return run["goodput_per_worker_second"][slo]
    return run["stats"]["slos"][slo]["met_rate"] / run["budget"]


def knee(by_rate: dict[float, list[dict]], slo: str, target: float, cfg: ExperimentConfig) -> GoodputResult:
    def recorded(rate: float) -> list[float]:
        if rate not in by_rate:
            raise ValueError(f"no runs at {rate} req/s: were these runs made with this config's [sweep] and [goodput]?")
        return attainment_samples([r["stats"] for r in by_rate[rate]], slo)

    return search_goodput(recorded, cfg.sweep.rates, target, cfg.search, cfg.sweep.interval)


def analyze(runs: Sequence[dict], cfg: ExperimentConfig) -> Analysis:
    targets = [(name, slo.attainment) for name, slo in cfg.slos]
    points, knees = [], []
    for (dep, workload), by_rate in _grouped(runs).items():
        points += [point(by_rate[rate], targets, cfg.sweep.interval) for rate in sorted(by_rate)]
        budget = by_rate[next(iter(by_rate))][0]["budget"]
        knees += [Knee(dep, workload, name, budget, knee(by_rate, name, target, cfg)) for name, target in targets]
    return Analysis(tuple(points), tuple(knees), cfg.sweep.interval)


@dataclass(frozen=True, slots=True)
class Verdict:
    leaders: tuple[str, ...]  # the best by mean, then every one whose interval overlaps the best's
    others: tuple[str, ...]  # told apart from (below) the best

    @property
    def winner(self) -> str | None:
        return self.leaders[0] if len(self.leaders) == 1 else None


def compare(items: Sequence[tuple[str, T]], mean: Callable[[T], float], overlap: Callable[[T, T], bool]) -> Verdict:
    """Name the best of items only where its interval overlaps no other's."""
    ranked = sorted(items, key=lambda item: mean(item[1]), reverse=True)
    best = ranked[0][1]
    leaders = [ranked[0][0], *(name for name, x in ranked[1:] if overlap(best, x))]
    return Verdict(tuple(leaders), tuple(name for name, _ in ranked if name not in leaders))


def compare_attainment(points: Sequence[Point], slo: str) -> Verdict:
    return compare([(p.deployment, p.slos[slo].both) for p in points], lambda i: i.mean, overlaps)


def compare_per_worker_second(points: Sequence[Point], slo: str) -> Verdict:
    return compare([(p.deployment, p.slos[slo].goodput_per_worker_second) for p in points], lambda i: i.mean, overlaps)


def compare_knees(knees: Sequence[Knee]) -> Verdict:
    """By goodput per worker; ranges from the repeats' intervals decide overlap."""
    return compare([(k.deployment, k.per_worker) for k in knees], lambda g: g.goodput, lambda a, b: a.range_overlaps(b))


def pd_grid(
    analysis: Analysis, cfg: ExperimentConfig, slo: str
) -> tuple[list[str], list[str], list[list[float | None]]]:
    """The P:D heat map: (layouts, ratio workloads, goodput per worker [layout][workload]; None: not run)."""
    if cfg.pd_sweep is None:
        return [], [], []
    layouts = [d.name for d in cfg.pd_sweep.layouts()]
    workloads = [name for name, _ in cfg.pd_workloads()]
    values = [
        [None if (k := analysis.knee(layout, w, slo)) is None else k.per_worker.goodput for w in workloads]
        for layout in layouts
    ]
    return layouts, workloads, values
