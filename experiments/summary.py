"""summary.md: how the runs were made, DistServe goodput per deployment (per worker), attainment and
goodput per worker by offered rate with intervals over repeats, fixed layouts vs the planner (workers
used, attainment, goodput per worker-second) when a deployment is autoscaled, the P:D heat map as a
table, and every run. A winner is named only where intervals do not overlap; elsewhere it says "not
distinguishable"."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from splitserve.experiments.analysis import (
    Analysis,
    Point,
    compare_attainment,
    compare_knees,
    compare_per_worker_second,
    pd_grid,
)
from splitserve.experiments.config import ExperimentConfig
from splitserve.experiments.intervals import NUM_RESAMPLES, Interval
from splitserve.experiments.plots import file_stem

INTERVAL_TEXT = {
    "t": "95% t-intervals over the repeats (mean +- t(0.975, n-1) * s / sqrt(n))",
    "bootstrap": f"95% percentile-bootstrap intervals over the repeats ({NUM_RESAMPLES} resamples, fixed seed)",
}


def _ms(values: dict, q: str) -> str:
    v = values.get(q)
    return "-" if v is None else f"{v:.0f}"


def _pct(i: Interval) -> str:
    if i.lo is None or i.hi is None:
        return f"{i.mean:.0%}"
    return f"{i.mean:.0%} [{i.lo * 100:.0f}, {i.hi * 100:.0f}]"


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


def _table(header: Sequence[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(r) + " |" for r in rows)]


def _header(cfg: ExperimentConfig) -> list[str]:
    sweep, search = cfg.sweep, cfg.search
    lines = [f"# Experiment {cfg.name}", ""]
    for name, slo in cfg.slos:
        ttft = "none" if slo.ttft_ms is None else f"<= {slo.ttft_ms:g} ms"
        tpot = "none" if slo.tpot_ms is None else f"<= {slo.tpot_ms:g} ms"
        lines.append(
            f"- SLO `{name}`: TTFT {ttft}, TPOT {tpot}; target: {slo.attainment:.0%} of counted requests meet "
            "both (failed requests meet neither)"
        )
    sizing = f"each sends for {sweep.duration_s:g} s" if sweep.duration_s else "each sends its workload's requests"
    window = "every request sent is counted"
    if sweep.warmup_s or sweep.cooldown_s:
        window = (
            f"requests sent in the first {sweep.warmup_s:g} s and the last {sweep.cooldown_s:g} s of a run load "
            "the server but are not counted"
        )
    lines.append(
        f"- Runs: {sweep.repeats} per offered rate, {sizing}; {window}. Realised rate: counted requests per "
        "second of the window (offered and realised differ by chance: Poisson arrivals)."
    )
    lines.append(
        f"- Intervals: {INTERVAL_TEXT[sweep.interval]}, written `mean [lo, hi]`; a single repeat has none. Where "
        "two deployments' intervals overlap the report says they are not distinguishable (a conservative test)."
    )
    more = ""
    if search.max_probes:
        more = f", then up to {search.max_probes} more by bisection to within {search.tolerance:.0%}"
    lines.append(
        "- Goodput (DistServe): the highest offered rate whose mean attainment meets the target, from the rates "
        f"{list(sweep.rates)}{more}. Per worker: divided by the deployment's workers (or its `gpus`). Goodput per "
        "worker by rate: requests meeting the SLO per window second, per worker (never above the realised rate)."
    )
    if cfg.autoscaled():
        lines.append(
            f"- Autoscaled ({', '.join(cfg.autoscaled())}): every run starts at the planner's minimum and the planner "
            "sizes the tiers while it sends. In the goodput tables their workers are the planner's budget (the most "
            "it may start); "
            "goodput per worker-second divides the requests meeting the SLO in the window by the integral of the "
            "live workers over it (for a fixed layout that is goodput per worker), so it compares them fairly."
        )
    return lines


def _knee_rows(analysis: Analysis, cfg: ExperimentConfig, workload: str, slo: str) -> list[list[str]]:
    rows = []
    for k in analysis.knees_of(workload, slo):
        r, w = k.result, k.per_worker
        rows.append(
            [
                k.deployment,
                f"<= {k.budget} (planner)" if k.deployment in cfg.autoscaled() else str(k.budget),
                f"{r.goodput:.3g}",
                f"**{w.goodput:.3g}**",
                _rate(r.ceiling) if r.converged or r.ceiling is None else f"{_rate(r.ceiling)} (not converged)",
                f"{w.range_lo:.3g} - {_rate(w.range_hi) if w.range_hi is not None else 'unbounded'}",
                ", ".join(f"{p.rate:g}{'' if p.passed else ' x'}" for p in sorted(r.probes, key=lambda p: p.rate)),
            ]
        )
    return rows


def _knee_verdict(analysis: Analysis, workload: str, slo: str, label: str) -> str | None:
    knees = analysis.knees_of(workload, slo)
    if len(knees) < 2:
        return None
    v = compare_knees(knees)
    if v.winner is not None:
        return f"- {label}: **{v.winner}** has the highest goodput per worker (its range overlaps no other's)"
    lower = f"; lower: {', '.join(v.others)}" if v.others else ""
    return f"- {label}: not distinguishable: {', '.join(v.leaders)} (their goodput ranges overlap){lower}"


def _goodput_section(analysis: Analysis, cfg: ExperimentConfig, workload: str) -> list[str]:
    header = ["deployment", "workers", "goodput req/s", "per worker", "fails at", "range per worker"]
    header.append("rates (x: missed)")
    lines = []
    for slo, _ in cfg.slos:
        lines += ["", f"### Goodput, SLO `{slo}`", "", *_table(header, _knee_rows(analysis, cfg, workload, slo))]
        verdict = _knee_verdict(analysis, workload, slo, f"SLO `{slo}`")
        lines += ["", verdict] if verdict else []
    return lines


def _point_row(p: Point, slo: str) -> list[str]:
    s = p.slos[slo]
    return [
        p.deployment,
        f"{p.rate:g}",
        p.realised_rate.format(3),
        f"{p.num_counted}/{p.num_sent}",
        _pct(s.ttft),
        _pct(s.tpot),
        _pct(s.both),
        s.goodput_per_worker.format(3),
        "yes" if s.passed else "no",
    ]


def _compared_by_rate(points: list[Point]) -> list[tuple[float, list[Point]]]:
    """The points of each offered rate, in rate order, where at least two deployments ran it."""
    by_rate = [(rate, [p for p in points if p.rate == rate]) for rate in sorted({p.rate for p in points})]
    return [(rate, at_rate) for rate, at_rate in by_rate if len(at_rate) >= 2]


def _rate_verdicts(points: list[Point], slo: str) -> list[str]:
    """One line per distinct verdict, listing the rates it holds at (rates with one deployment: none)."""
    rates_by_verdict: dict[str, list[str]] = {}
    for rate, at_rate in _compared_by_rate(points):
        v = compare_attainment(at_rate, slo)
        if v.winner is not None:
            verdict = f"**{v.winner}** has the highest attainment (intervals do not overlap)"
        else:
            tied = ", ".join(sorted(v.leaders))
            verdict = f"not distinguishable at this rate: {tied} (attainment intervals overlap)"
        rates_by_verdict.setdefault(verdict, []).append(f"{rate:g}")
    return [f"- {', '.join(rates)} req/s: {verdict}" for verdict, rates in rates_by_verdict.items()]


def _rates_section(analysis: Analysis, cfg: ExperimentConfig, workload: str) -> list[str]:
    header = ["deployment", "offered req/s", "realised req/s", "counted/sent", "TTFT met", "TPOT met", "both met"]
    lines = []
    points = analysis.points_of(workload)
    for slo, objectives in cfg.slos:
        rows = [_point_row(p, slo) for p in points]
        table = _table([*header, "goodput/worker req/s", f">= {objectives.attainment:.0%}"], rows)
        lines += ["", f"### By offered rate, SLO `{slo}`", "", *table, "", *_rate_verdicts(points, slo)]
    return lines


def _fleet_row(p: Point, slo: str) -> list[str]:
    s = p.slos[slo]
    return [p.deployment, f"{p.rate:g}", p.mean_workers.format(2), _pct(s.both), s.goodput_per_worker_second.format(3)]


def _fleet_verdicts(points: list[Point], slo: str) -> list[str]:
    lines = []
    for rate, at_rate in _compared_by_rate(points):
        v = compare_per_worker_second(at_rate, slo)
        if v.winner is not None:
            lines.append(f"- {rate:g} req/s: **{v.winner}** has the highest goodput per worker-second")
        else:
            lines.append(f"- {rate:g} req/s: not distinguishable: {', '.join(sorted(v.leaders))} (intervals overlap)")
    return lines


def _fleet_section(analysis: Analysis, cfg: ExperimentConfig, workload: str) -> list[str]:
    """Fixed layouts vs the planner: the workers each used, its SLO attainment, goodput per worker-second."""
    points = analysis.points_of(workload)
    if not any(p.deployment in cfg.autoscaled() for p in points):
        return []
    header = ["deployment", "offered req/s", "workers (mean in window)", "both met", "goodput per worker-second"]
    lines = []
    for slo, _ in cfg.slos:
        table = _table(header, [_fleet_row(p, slo) for p in points])
        lines += ["", f"### Fixed layouts vs the planner, SLO `{slo}`", "", *table, "", *_fleet_verdicts(points, slo)]
    return [*lines, "", f"Workers over time: `{file_stem(workload)}-workers_over_time.png`."]


def _pd_section(analysis: Analysis, cfg: ExperimentConfig) -> list[str]:
    if cfg.pd_sweep is None:
        return []
    lines = ["", f"## P:D layouts at a budget of {cfg.pd_sweep.budget} workers", ""]
    lines.append("Goodput per worker (req/s, DistServe) by layout and prompt:output length ratio.")
    for slo, _ in cfg.slos:
        layouts, workloads, values = pd_grid(analysis, cfg, slo)
        rows = [[layout, *(_rate(v) for v in row)] for layout, row in zip(layouts, values)]
        lines += ["", f"SLO `{slo}`:", "", *_table(["layout", *workloads], rows), ""]
        lines += [line for w in workloads if (line := _knee_verdict(analysis, w, slo, f"`{w}`"))]
    return lines


def _runs_section(runs: list[dict], cfg: ExperimentConfig, workload: str) -> list[str]:
    slo_names = [name for name, _ in cfg.slos]
    header = ["deployment", "rate", "ok", "repeat", "counted", "realised req/s", "out tok/s"]
    header += ["TTFT p50", "TTFT p90", "TPOT p50", "TPOT p90", *(f"met/s {n}" for n in slo_names)]
    rows = []
    for r in (r for r in runs if r["workload"] == workload):
        s, st = r["summary"], r["stats"]
        rows.append(
            [r["deployment"], str(r["rate"]), f"{s['num_ok']}/{s['num_requests']}", str(r["repeat"] + 1)]
            + [str(st["num_counted"]), f"{st['realised_rate']:.2f}", f"{s['output_throughput']:.1f}"]
            + [_ms(s["ttft_ms"], "p50"), _ms(s["ttft_ms"], "p90"), _ms(s["tpot_ms"], "p50"), _ms(s["tpot_ms"], "p90")]
            + [f"{st['slos'][n]['met_rate']:.2f}" for n in slo_names]
        )
    return ["", f"### Every run of `{workload}`", "", *_table(header, rows)]


def write_summary(runs: list[dict], analysis: Analysis, cfg: ExperimentConfig, out: Path) -> Path:
    lines = _header(cfg)
    for workload in analysis.workloads():
        lines += ["", f"## Workload `{workload}`"]
        lines += _goodput_section(analysis, cfg, workload) + _rates_section(analysis, cfg, workload)
        lines += _fleet_section(analysis, cfg, workload)
    lines += _pd_section(analysis, cfg)
    lines += ["", "## Runs (latencies in ms, over every request sent)"]
    for workload in analysis.workloads():
        lines += _runs_section(runs, cfg, workload)
    path = out / "summary.md"
    path.write_text("\n".join(lines) + "\n")
    return path
