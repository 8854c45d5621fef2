"""The benchmark's report: a terminal table and JSON."""

from __future__ import annotations

import json
from dataclasses import asdict

from splitserve.experiments.stats import RequestRecord, Summary


def format_table(s: Summary) -> str:
    lines = [
        f"requests: {s.num_ok}/{s.num_requests} ok in {s.duration_s:.2f} s; "
        f"throughput {s.request_throughput:.2f} req/s, {s.output_throughput:.1f} output tok/s",
        f"goodput {s.goodput:.2f} req/s ({s.slo_attainment:.0%} of requests met "
        f"ttft_ms<={s.slo['ttft_ms']}, tpot_ms<={s.slo['tpot_ms']}; "
        f"TTFT alone {s.ttft_attainment:.0%}, TPOT alone {s.tpot_attainment:.0%})",
        f"{'metric (ms)':<12}{'p50':>10}{'p90':>10}{'p99':>10}{'mean':>10}",
    ]
    for name, values in (
        ("TTFT", s.ttft_ms),
        ("ITL", s.itl_ms),
        ("TPOT", s.tpot_ms),
        ("E2E", s.e2e_ms),
        ("queue", s.queue_ms),
    ):
        cells = "".join(
            f"{values[k]:>10.1f}" if values[k] is not None else f"{'-':>10}" for k in ("p50", "p90", "p99", "mean")
        )
        lines.append(f"{name:<12}{cells}")
    if s.errors:
        lines.append("errors: " + ", ".join(f"{code} x{n}" for code, n in sorted(s.errors.items())))
    return "\n".join(lines)


def to_json(summary: Summary, records: list[RequestRecord], settings: dict) -> str:
    return json.dumps(
        {"settings": settings, "summary": summary.to_dict(), "requests": [asdict(r) for r in records]}, indent=1
    )
