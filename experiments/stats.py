"""Per-request latency records and the arithmetic on them: TPOT, percentiles, SLO attainment, goodput.

TPOT = (E2E - TTFT) / (output tokens - 1). A request meets an SLO when it succeeded and meets both its
TTFT and its TPOT objective; attainment is the share of requests that do (failed requests count as
missing). Two goodputs: `Summary.goodput` (and `RunStats.met_rate`) is requests meeting the SLO per
second; DistServe's goodput is the highest offered rate whose attainment stays at or above a target
(e.g. 90%), found over many runs by goodput.py.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field


@dataclass(slots=True)
class RequestRecord:
    """One request as the client saw it; times in seconds from its send."""

    prompt_tokens: int
    max_tokens: int
    code: str = "OK"  # or how it failed: a gRPC status name, "HTTP 429", a transport error (loadgen.ClientError)
    ttft_s: float | None = None
    token_times_s: list[float] = field(default_factory=list)  # arrival of each output token
    e2e_s: float | None = None
    queue_ms: float | None = None  # reported by the server on the last chunk (splitserve's gRPC API only)
    start_s: float = 0.0  # send time relative to the run's start

    @property
    def ok(self) -> bool:
        return self.code == "OK"

    @property
    def output_tokens(self) -> int:
        return len(self.token_times_s)

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    @property
    def itls_s(self) -> list[float]:
        t = self.token_times_s
        return [b - a for a, b in zip(t, t[1:])]


@dataclass(frozen=True, slots=True)
class SLO:
    """Latency objectives (None: no objective) and the share of requests that must meet both."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    attainment: float = 0.9  # DistServe's attainment target: a rate is served when this share meets the SLO

    def __post_init__(self) -> None:
        if not 0.0 < self.attainment <= 1.0:
            raise ValueError(f"SLO attainment is a share of requests in (0, 1], got {self.attainment}")

    def ttft_met(self, r: RequestRecord) -> bool:
        return r.ok and (self.ttft_ms is None or (r.ttft_s is not None and r.ttft_s * 1e3 <= self.ttft_ms))

    def tpot_met(self, r: RequestRecord) -> bool:
        # One output token has no TPOT: nothing to miss.
        tpot = r.tpot_s
        return r.ok and (self.tpot_ms is None or tpot is None or tpot * 1e3 <= self.tpot_ms)

    def met_by(self, r: RequestRecord) -> bool:
        return self.ttft_met(r) and self.tpot_met(r)

    @classmethod
    def parse(cls, text: str) -> SLO:
        """'ttft_ms=500,tpot_ms=50' (either may be left out; attainment=0.9 sets the target)."""
        values: dict[str, float] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, _, value = part.partition("=")
            if key not in ("ttft_ms", "tpot_ms", "attainment") or not value:
                raise ValueError(f"--slo takes ttft_ms=N,tpot_ms=N[,attainment=F]; got {part!r}")
            values[key] = float(value)
        return cls(**values)


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in 0..100), as numpy's default; None for no values."""
    if not values:
        return None
    data = sorted(values)
    pos = (len(data) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


@dataclass(frozen=True, slots=True)
class Summary:
    num_requests: int
    num_ok: int
    duration_s: float
    request_throughput: float  # completed requests / s
    output_throughput: float  # output tokens / s
    goodput: float  # completed requests meeting the SLO / s
    slo_attainment: float  # fraction of all requests meeting the SLO (TTFT and TPOT)
    ttft_attainment: float  # fraction of all requests meeting the TTFT objective
    tpot_attainment: float  # fraction of all requests meeting the TPOT objective
    ttft_ms: dict[str, float | None]
    itl_ms: dict[str, float | None]
    tpot_ms: dict[str, float | None]
    e2e_ms: dict[str, float | None]
    queue_ms: dict[str, float | None]
    errors: dict[str, int]
    slo: dict[str, float | None]

    def to_dict(self) -> dict:
        return asdict(self)


def _pcts(values_s: Sequence[float], scale: float = 1e3) -> dict[str, float | None]:
    values = [v * scale for v in values_s]
    out = {f"p{q}": percentile(values, q) for q in (50, 90, 99)}
    out["mean"] = sum(values) / len(values) if values else None
    return out


def summarize(records: Sequence[RequestRecord], duration_s: float, slo: SLO = SLO()) -> Summary:
    ok = [r for r in records if r.ok]
    duration = max(duration_s, 1e-9)
    return Summary(
        num_requests=len(records),
        num_ok=len(ok),
        duration_s=duration_s,
        request_throughput=len(ok) / duration,
        output_throughput=sum(r.output_tokens for r in ok) / duration,
        goodput=sum(map(slo.met_by, records)) / duration,
        slo_attainment=_share(records, slo.met_by),
        ttft_attainment=_share(records, slo.ttft_met),
        tpot_attainment=_share(records, slo.tpot_met),
        ttft_ms=_pcts([r.ttft_s for r in ok if r.ttft_s is not None]),
        itl_ms=_pcts([x for r in ok for x in r.itls_s]),
        tpot_ms=_pcts([t for r in ok if (t := r.tpot_s) is not None]),
        e2e_ms=_pcts([r.e2e_s for r in ok if r.e2e_s is not None]),
        queue_ms=_pcts([r.queue_ms for r in ok if r.queue_ms is not None], scale=1.0),
        errors=dict(Counter(r.code for r in records if not r.ok)),
        slo={"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms},
    )


def _share(records: Sequence[RequestRecord], met: Callable[[RequestRecord], bool]) -> float:
    """The share of records met accepts; 0 for none (see attainment_samples for how an empty run counts)."""
    return sum(map(met, records)) / len(records) if records else 0.0


def attainment_samples(stats: Sequence[dict], slo: str, key: str = "both") -> list[float]:
    """One attainment per run (RunStats.to_dict()s) of runs that counted at least one request: a run
    whose window saw no arrival (a low rate, a short window) is no evidence either way. [0.0] when no
    run counted any (the rate cannot be said to be served)."""
    samples = [s["slos"][slo][key] for s in stats if s["num_counted"]]
    return samples or [0.0]


@dataclass(frozen=True, slots=True)
class Window:
    """The measurement window of one run. Requests sent in its first warmup_s seconds (an empty server
    filling up) or its last cooldown_s seconds (a server draining, no longer loaded at the offered rate)
    are sent, so the load is real, but not counted."""

    warmup_s: float = 0.0
    cooldown_s: float = 0.0

    def __post_init__(self) -> None:
        if self.warmup_s < 0 or self.cooldown_s < 0:
            raise ValueError("warmup_s and cooldown_s must be >= 0")

    def bounds(self, records: Sequence[RequestRecord], planned_s: float | None) -> tuple[float, float]:
        """[start, end] in seconds from the run's start. The send span is the planned duration, or the
        last send when the run was sized by count (a send late by scheduling jitter stretches it)."""
        span = max([planned_s or 0.0, *(r.start_s for r in records)])
        start, end = self.warmup_s, span - self.cooldown_s
        if end <= start:  # no time to measure a rate over
            raise ValueError(
                f"a run sent over {span:.2f} s leaves no measurement window after a {self.warmup_s} s warm-up "
                f"and a {self.cooldown_s} s cool-down: size runs by duration_s (longer than both) or send more requests"
            )
        return start, end

    def counted(self, records: Sequence[RequestRecord], planned_s: float | None) -> list[RequestRecord]:
        start, end = self.bounds(records, planned_s)
        return [r for r in records if start <= r.start_s <= end]


@dataclass(frozen=True, slots=True)
class SLOStats:
    """One run against one SLO, over the requests its window counts."""

    ttft: float  # attainment of the TTFT objective alone
    tpot: float  # ... of the TPOT objective alone
    both: float  # ... of both: the SLO attainment
    num_met: int  # counted requests meeting both
    met_rate: float  # requests meeting both / window seconds: never above the realised rate
    passed: bool  # both >= the SLO's attainment target
    distserve_goodput: float  # the offered rate when passed, else 0 (DistServe's goodput of one run)


@dataclass(frozen=True, slots=True)
class RunStats:
    """One run's counted requests: the offered rate beside the realised one, and attainment per SLO."""

    offered_rate: float
    window_start_s: float
    window_end_s: float
    num_sent: int
    num_counted: int
    realised_rate: float  # counted requests / window seconds
    slos: dict[str, SLOStats]

    @property
    def window_s(self) -> float:
        return self.window_end_s - self.window_start_s

    def to_dict(self) -> dict:
        return asdict(self) | {"window_s": self.window_s}


def run_stats(
    records: Sequence[RequestRecord],
    offered_rate: float,
    slos: Sequence[tuple[str, SLO]],
    window: Window = Window(),
    planned_s: float | None = None,
) -> RunStats:
    start, end = window.bounds(records, planned_s)
    counted = window.counted(records, planned_s)
    seconds = end - start
    return RunStats(
        offered_rate=offered_rate,
        window_start_s=start,
        window_end_s=end,
        num_sent=len(records),
        num_counted=len(counted),
        realised_rate=len(counted) / seconds,
        slos={name: _slo_stats(counted, slo, seconds, offered_rate) for name, slo in slos},
    )


def _slo_stats(counted: Sequence[RequestRecord], slo: SLO, seconds: float, offered_rate: float) -> SLOStats:
    both = _share(counted, slo.met_by)
    passed = both >= slo.attainment
    num_met = sum(map(slo.met_by, counted))
    return SLOStats(
        ttft=_share(counted, slo.ttft_met),
        tpot=_share(counted, slo.tpot_met),
        both=both,
        num_met=num_met,
        met_rate=num_met / seconds,
        passed=passed,
        distserve_goodput=offered_rate if passed else 0.0,
    )
