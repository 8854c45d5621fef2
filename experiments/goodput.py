"""DistServe's goodput: the highest offered request rate at which the SLO attainment stays at or above
its target (e.g. 90% of requests meet both TTFT and TPOT), found by a search over rates.

The search is a pure function over `probe(rate) -> attainment samples` (one per repeat), so a test can
drive it with a synthetic attainment curve and the harness with real runs:

1. probe every starting rate (the config's grid);
2. bracket the knee: the floor is the highest passing rate below the lowest failing one (the ceiling);
   when every rate passed, double the highest; when even the lowest failed, halve it;
3. bisect between floor and ceiling until ceiling <= floor * (1 + tolerance), or max_probes more rates
   were tried (expanding the bracket counts).

A rate passes when its mean attainment over repeats is >= the target. Passing rates above the lowest
failing one are not believed (noise, or a server that recovers under more load): the goodput is the floor.
The repeats' intervals give a second, wider range: from the highest rate whose whole interval (and every
lower rate's) sits at or above the target, to the lowest rate whose whole interval sits below it. Two
deployments whose ranges overlap are not distinguishable by this experiment.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from splitserve.experiments.intervals import Interval, interval

Probe = Callable[[float], Sequence[float]]  # offered rate -> attainment of each repeat at that rate


@dataclass(frozen=True, slots=True)
class SearchConfig:
    """[goodput] in an experiment config."""

    tolerance: float = 0.1  # stop when the ceiling is within this fraction above the floor
    max_probes: int = 0  # rates tried beyond the starting ones; 0: the grid only

    def __post_init__(self) -> None:
        if not 0.001 <= self.tolerance <= 1.0:
            raise ValueError(f"goodput tolerance is relative, in [0.001, 1], got {self.tolerance}")
        if self.max_probes < 0:
            raise ValueError(f"goodput max_probes must be >= 0, got {self.max_probes}")


@dataclass(frozen=True, slots=True)
class RateProbe:
    rate: float
    attainment: Interval  # over the repeats at this rate
    passed: bool  # mean attainment >= target


@dataclass(frozen=True, slots=True)
class GoodputResult:
    goodput: float  # the floor: highest passing rate below every failing one; 0 when none passed
    ceiling: float | None  # the lowest failing rate (the knee is in [goodput, ceiling)); None: none failed
    range_lo: float  # what the repeats' intervals allow: surely served up to here (0: nowhere for sure) ...
    range_hi: float | None  # ... and surely not from here on (None: nowhere for sure)
    converged: bool  # ceiling within tolerance of the floor
    probes: tuple[RateProbe, ...]  # in the order they ran

    def per_worker(self, num_workers: int) -> GoodputResult:
        """The same result with every rate divided among num_workers (or GPUs)."""
        if num_workers < 1:
            raise ValueError(f"goodput per worker needs at least one worker, got {num_workers}")
        return GoodputResult(
            self.goodput / num_workers,
            None if self.ceiling is None else self.ceiling / num_workers,
            self.range_lo / num_workers,
            None if self.range_hi is None else self.range_hi / num_workers,
            self.converged,
            self.probes,
        )

    def range_overlaps(self, other: GoodputResult) -> bool:
        """Whether the two knees could be at the same rate, given the repeats' intervals."""
        return _below(self.range_lo, other.range_hi) and _below(other.range_lo, self.range_hi)


def _below(lo: float, hi: float | None) -> bool:
    return hi is None or lo < hi


def search_goodput(
    probe: Probe, rates: Iterable[float], target: float, cfg: SearchConfig = SearchConfig(), method: str = "t"
) -> GoodputResult:
    """Probe the starting rates, then expand or bisect the bracket (module docstring)."""
    probes: dict[float, RateProbe] = {}

    def run(rate: float) -> None:
        samples = probe(rate)
        mean_ok = sum(samples) / len(samples) >= target
        probes[rate] = RateProbe(rate, interval(samples, method, bounds=(0.0, 1.0)), mean_ok)

    for rate in sorted(set(rates)):
        run(rate)
    for _ in range(cfg.max_probes):
        extra = next_rate(probes.values(), cfg.tolerance)
        if extra is None or extra in probes:
            break
        run(extra)
    return _result(list(probes.values()), target, cfg.tolerance)


def bracket(probes: Iterable[RateProbe]) -> tuple[float | None, float | None]:
    """(floor, ceiling): the highest passing rate below the lowest failing one, and that failing rate."""
    probes = list(probes)
    ceiling = min((p.rate for p in probes if not p.passed), default=None)
    floor = max((p.rate for p in probes if p.passed and _below(p.rate, ceiling)), default=None)
    return floor, ceiling


def next_rate(probes: Iterable[RateProbe], tolerance: float) -> float | None:
    """The next rate to probe, or None when the bracket is narrow enough."""
    floor, ceiling = bracket(probes)
    if ceiling is None:
        if floor is None:
            raise ValueError("the goodput search needs at least one starting rate")
        return _round(2 * floor)  # every rate passed: look higher
    if floor is None:
        return _round(ceiling / 2)  # even the lowest failed: look lower
    if ceiling <= floor * (1 + tolerance):
        return None
    return _round((floor + ceiling) / 2)


def _round(rate: float) -> float:
    """4 significant digits: readable rates in the report, still distinct at tolerance >= 0.001."""
    return float(f"{rate:.4g}")


def _result(probes: list[RateProbe], target: float, tolerance: float) -> GoodputResult:
    floor, ceiling = bracket(probes)
    converged = floor is not None and ceiling is not None and ceiling <= floor * (1 + tolerance)
    range_lo, range_hi = _interval_range(probes, target)
    return GoodputResult(floor or 0.0, ceiling, range_lo, range_hi, converged, tuple(probes))


def _interval_range(probes: list[RateProbe], target: float) -> tuple[float, float | None]:
    """(highest rate up to which every interval is wholly >= target, lowest rate wholly < target)."""
    by_rate = sorted(probes, key=lambda p: p.rate)
    surely_fails = [p.rate for p in by_rate if p.attainment.hi is not None and p.attainment.hi < target]
    range_lo = 0.0
    for p in by_rate:
        if p.attainment.lo is None or p.attainment.lo < target:
            break
        range_lo = p.rate
    return range_lo, min(surely_fails, default=None)
