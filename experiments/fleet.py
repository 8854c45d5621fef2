"""The workers a deployment runs on during each run, and goodput per worker-second.

A fixed layout (unified xN, xPyD, an endpoint) has the same workers all along. An autoscaled one (a
deployment with an `autoscale` table) starts every run at the planner's minimum with a fresh policy, and
the planner (services/launcher/autoscale.py, in this process) sizes its tiers while the run sends; its live workers
per tier are sampled every second (a starting worker counts from its spawn, a drained one until it exits:
both hold a core or a GPU). Goodput per worker-second = counted requests meeting the SLO / the integral of
the live worker count over the measurement window: for a fixed layout, goodput per worker.
"""

from __future__ import annotations

import io
import json
import math
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Protocol

from splitserve.common.security import OPEN_CLUSTER, ClusterSecurity
from splitserve.experiments.stats import RunStats
from splitserve.services.launcher.autoscale import AutoscaleSettings, PlannerThread, Scalable, SupervisorScaler
from splitserve.services.launcher.launcher import Child

SAMPLE_S = 1.0  # seconds between samples of an autoscaled deployment's workers
SETTLE_S = 300.0  # after a run, how long to wait for a Scale call in flight before the next run resets


@dataclass(frozen=True, slots=True)
class WorkerTimeline:
    """Live workers per tier over one run, a step function: each sample's counts hold from its time
    (seconds from the run's first send) until the next sample's; the first sample's hold before it too."""

    samples: tuple[tuple[float, Mapping[str, int]], ...]

    def __post_init__(self) -> None:
        if not self.samples:
            raise ValueError("a worker timeline needs at least one sample")
        times = [t for t, _ in self.samples]
        if times != sorted(times):
            raise ValueError(f"a worker timeline's samples go in time order, got times {times}")

    def worker_seconds(self, start: float, end: float) -> float:
        """The integral of the total worker count over [start, end]."""
        if end < start:
            raise ValueError(f"need start <= end, got [{start}, {end}]")
        edges = [-math.inf, *(t for t, _ in self.samples[1:]), math.inf]
        return sum(
            max(0.0, min(hi, end) - max(lo, start)) * sum(counts.values())
            for lo, hi, (_, counts) in zip(edges, edges[1:], self.samples)
        )

    def tiers(self) -> list[str]:
        """Every tier any sample counts, in the order they first appear."""
        return list(dict.fromkeys(tier for _, counts in self.samples for tier in counts))

    def compact(self) -> WorkerTimeline:
        """The same step function without samples that repeat the one before (the last one is kept: it
        marks how long the recording ran)."""
        kept = [s for i, s in enumerate(self.samples) if i == 0 or s[1] != self.samples[i - 1][1]]
        if len(self.samples) > 1 and kept[-1] is not self.samples[-1]:
            kept.append(self.samples[-1])
        return WorkerTimeline(tuple(kept))

    def to_json(self) -> list:
        return [[round(t, 3), dict(counts)] for t, counts in self.samples]

    @classmethod
    def from_json(cls, data: list) -> WorkerTimeline:
        return cls(tuple((float(t), dict(counts)) for t, counts in data))


def workers_used(timeline: WorkerTimeline, stats: RunStats) -> tuple[dict, dict[str, float]]:
    """(the run's "workers" record: timeline, worker-seconds and mean workers over the measurement window;
    goodput per worker-second for each SLO)."""
    seconds = timeline.worker_seconds(stats.window_start_s, stats.window_end_s)
    used = {"timeline": timeline.to_json(), "worker_seconds": seconds, "mean": seconds / stats.window_s}
    per_worker_second = {name: s.num_met / seconds if seconds > 0 else 0.0 for name, s in stats.slos.items()}
    return used, per_worker_second


@dataclass
class FleetRun:
    """What one run's workers did: samples of live workers per tier (time.perf_counter() seconds), and the
    planner's decision log (JSON records) when a planner ran."""

    samples: list[tuple[float, dict[str, int]]] = field(default_factory=list)
    decisions: list[dict] | None = None

    def timeline(self, origin: float) -> WorkerTimeline:
        """The samples in seconds from origin (the run's first send), those before it as one at 0."""
        shifted = [(t - origin, counts) for t, counts in self.samples]
        before = [counts for t, counts in shifted if t <= 0]
        head = [(0.0, before[-1])] if before else []
        return WorkerTimeline(tuple(head + [(t, c) for t, c in shifted if t > 0])).compact()


class Fleet(Protocol):
    def run(self) -> AbstractContextManager[FleetRun]:
        """Around one run's sending: ready the workers, record what they do until the block ends."""
        ...


class FixedFleet:
    """A layout that keeps its workers: counts per tier (an endpoint: its GPUs, else 1)."""

    def __init__(self, counts: Mapping[str, int]) -> None:
        self.counts = dict(counts)

    @contextmanager
    def run(self) -> Iterator[FleetRun]:
        yield FleetRun([(-math.inf, self.counts)])


class Sampler:
    """Calls count() now, every period_s on a thread of its own, and once more at stop(), appending
    (time.perf_counter(), counts) to into."""

    def __init__(self, count: Callable[[], dict[str, int]], period_s: float, into: list) -> None:
        self.count, self.period_s, self.into = count, period_s, into
        self._stop = threading.Event()
        self._sample()
        self._thread = threading.Thread(target=self._run, name="worker-sampler", daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        self.into.append((time.perf_counter(), self.count()))

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self._sample()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()


class Workers(Scalable, Protocol):
    """What an autoscaled fleet needs of services/launcher/supervisor.py's Supervisor besides scaling."""

    def workers(self, mode: str) -> list[Child]: ...


class AutoscaledFleet:
    """A deployment sized by the planner in this process. Each run: scale to the planner's minimum, start a
    fresh planner, sample the workers every sample_s; after it: stop the planner and wait for its Scale
    call in flight (up to settle_s), so the next run starts from a settled system."""

    def __init__(
        self,
        supervisor: Workers,
        gateway: Child,
        settings: AutoscaleSettings,
        cluster: ClusterSecurity = OPEN_CLUSTER,
        sample_s: float = SAMPLE_S,
        settle_s: float = SETTLE_S,
    ) -> None:
        self.supervisor, self.gateway, self.settings, self.cluster = supervisor, gateway, settings, cluster
        self.sample_s, self.settle_s = sample_s, settle_s

    def counts(self) -> dict[str, int]:
        """Live workers of each planned tier."""
        return {role.value: len(self.supervisor.workers(role.value)) for role in self.settings.config.tiers}

    @contextmanager
    def run(self) -> Iterator[FleetRun]:
        self.supervisor.scale({role.value: n for role, n in self.settings.minimum().items()})
        log = io.StringIO()
        used = FleetRun()
        loop = self.settings.make_loop(self.gateway, self.cluster, SupervisorScaler(self.supervisor), log)
        sampler = Sampler(self.counts, self.sample_s, used.samples)
        planner = PlannerThread(loop, self.settings.interval_s)
        try:
            yield used
        finally:
            planner.stop()
            planner.wait_for_scale(self.settle_s)
            sampler.stop()
            used.decisions = [json.loads(line) for line in log.getvalue().splitlines()]
