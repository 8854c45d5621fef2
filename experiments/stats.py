"""Per-request latency records and the arithmetic on them: TPOT, percentiles, goodput.

TPOT = (E2E - TTFT) / (output tokens - 1). Goodput (DistServe) = completed requests per second that
meet both the TTFT and the TPOT objective.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
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
    ttft_ms: float | None = None
    tpot_ms: float | None = None

    def met_by(self, r: RequestRecord) -> bool:
        if not r.ok:
            return False
        if self.ttft_ms is not None and (r.ttft_s is None or r.ttft_s * 1e3 > self.ttft_ms):
            return False
        tpot = r.tpot_s
        return self.tpot_ms is None or tpot is None or tpot * 1e3 <= self.tpot_ms

    @classmethod
    def parse(cls, text: str) -> SLO:
        """'ttft_ms=500,tpot_ms=50' (either may be left out)."""
        values: dict[str, float] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, _, value = part.partition("=")
            if key not in ("ttft_ms", "tpot_ms") or not value:
                raise ValueError(f"--slo takes ttft_ms=N,tpot_ms=N; got {part!r}")
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
    slo_attainment: float  # fraction of all requests meeting the SLO
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
    met = [r for r in records if slo.met_by(r)]
    duration = max(duration_s, 1e-9)
    return Summary(
        num_requests=len(records),
        num_ok=len(ok),
        duration_s=duration_s,
        request_throughput=len(ok) / duration,
        output_throughput=sum(r.output_tokens for r in ok) / duration,
        goodput=len(met) / duration,
        slo_attainment=len(met) / len(records) if records else 0.0,
        ttft_ms=_pcts([r.ttft_s for r in ok if r.ttft_s is not None]),
        itl_ms=_pcts([x for r in ok for x in r.itls_s]),
        tpot_ms=_pcts([t for r in ok if (t := r.tpot_s) is not None]),
        e2e_ms=_pcts([r.e2e_s for r in ok if r.e2e_s is not None]),
        queue_ms=_pcts([r.queue_ms for r in ok if r.queue_ms is not None], scale=1.0),
        errors=dict(Counter(r.code for r in records if not r.ok)),
        slo={"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms},
    )
