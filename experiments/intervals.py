"""95% confidence intervals of a mean over repeated runs, and whether two of them overlap.

Two methods (the report names the one it used):
- "t": Student's t-interval, mean +- t_{0.975, n-1} * s / sqrt(n). Right for few repeats of a roughly
  normal quantity; the quantiles are tabulated below (no scipy).
- "bootstrap": the percentile bootstrap (2,000 resamples of the repeats, a fixed seed). It assumes
  nothing about the shape but needs more repeats than the t-interval to mean much (with 3 repeats it
  is too narrow).

`overlaps` is how the report compares deployments: when two 95% intervals share a point it says the two
are not distinguishable. That is conservative (two means can differ significantly while their
intervals still overlap a little), so a named winner is a safe claim, and a tie is only "not shown".
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from splitserve.experiments.stats import percentile

# t_{0.975, df} for df = 1..30, from any statistics table (scipy.stats.t.ppf(0.975, df), 4 decimals).
T_975 = (
    12.7062, 4.3027, 3.1824, 2.7764, 2.5706, 2.4469, 2.3646, 2.3060, 2.2622, 2.2281,
    2.2010, 2.1788, 2.1604, 2.1448, 2.1314, 2.1199, 2.1098, 2.1009, 2.0930, 2.0860,
    2.0796, 2.0739, 2.0687, 2.0639, 2.0595, 2.0555, 2.0518, 2.0484, 2.0452, 2.0423,
)  # fmt: skip
Z_975 = 1.959964
NUM_RESAMPLES = 2000
BOOTSTRAP_SEED = 0


def t_975(df: int) -> float:
    """The 97.5% quantile of Student's t with df degrees of freedom (two-sided 95%)."""
    if df < 1:
        raise ValueError(f"a t quantile needs df >= 1, got {df}")
    if df <= len(T_975):
        return T_975[df - 1]
    # Cornish-Fisher expansion around the normal quantile: within 1e-4 of the exact value beyond df 30.
    z = Z_975
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


@dataclass(frozen=True, slots=True)
class Interval:
    """The mean of n repeats and its 95% confidence interval. lo and hi are None for a single repeat:
    one run says nothing about its own spread, so it can be told apart from nothing."""

    mean: float
    lo: float | None
    hi: float | None
    n: int
    method: str  # "t" or "bootstrap"

    def format(self, digits: int = 2) -> str:
        if self.lo is None or self.hi is None:
            return f"{self.mean:.{digits}f}"
        return f"{self.mean:.{digits}f} [{self.lo:.{digits}f}, {self.hi:.{digits}f}]"


def _mean(samples: Sequence[float]) -> float:
    return sum(samples) / len(samples)


def _clip(value: float, bounds: tuple[float, float] | None) -> float:
    return value if bounds is None else min(max(value, bounds[0]), bounds[1])


def t_interval(samples: Sequence[float], bounds: tuple[float, float] | None = None) -> Interval:
    """Mean +- t * s / sqrt(n), clipped to bounds (e.g. (0, 1) for an attainment)."""
    n, mean = len(samples), _mean(samples)
    if n < 2:
        return Interval(mean, None, None, n, "t")
    sd = math.sqrt(sum((x - mean) ** 2 for x in samples) / (n - 1))
    half = t_975(n - 1) * sd / math.sqrt(n)
    return Interval(mean, _clip(mean - half, bounds), _clip(mean + half, bounds), n, "t")


def bootstrap_interval(
    samples: Sequence[float], bounds: tuple[float, float] | None = None, seed: int = BOOTSTRAP_SEED
) -> Interval:
    """The 2.5th and 97.5th percentiles of the means of NUM_RESAMPLES resamples (with replacement)."""
    n, mean = len(samples), _mean(samples)
    if n < 2:
        return Interval(mean, None, None, n, "bootstrap")
    rng = random.Random(seed)  # fixed: the same runs always give the same report
    means = [_mean(rng.choices(samples, k=n)) for _ in range(NUM_RESAMPLES)]
    lo, hi = percentile(means, 2.5), percentile(means, 97.5)
    assert lo is not None and hi is not None  # means is never empty
    return Interval(mean, _clip(lo, bounds), _clip(hi, bounds), n, "bootstrap")


METHODS: dict[str, Callable[..., Interval]] = {"t": t_interval, "bootstrap": bootstrap_interval}


def interval(samples: Sequence[float], method: str = "t", bounds: tuple[float, float] | None = None) -> Interval:
    if not samples:
        raise ValueError("an interval needs at least one sample")
    if method not in METHODS:
        raise ValueError(f"interval method must be one of {sorted(METHODS)}, got {method!r}")
    return METHODS[method](samples, bounds)


def overlaps(a: Interval, b: Interval) -> bool:
    """True when a and b cannot be told apart: either lacks an interval, or the two share a point."""
    if a.lo is None or a.hi is None or b.lo is None or b.hi is None:
        return True
    return a.lo <= b.hi and b.lo <= a.hi
