"""summary.md: one row per run, and the best deployment per SLO (highest peak goodput)."""

from __future__ import annotations

from pathlib import Path


def _ms(values: dict, q: str) -> str:
    v = values.get(q)
    return "-" if v is None else f"{v:.0f}"


def best_per_slo(runs: list[dict], workload: str, slo: str) -> tuple[str, float, float] | None:
    """(deployment(s), peak goodput, the lowest rate it was reached at) for one workload and SLO;
    deployments that tie on peak goodput are all named."""
    peaks: dict[str, tuple[float, float]] = {}
    for r in (r for r in runs if r["workload"] == workload):
        best = peaks.get(r["deployment"])
        if best is None or r["goodput"][slo] > best[0]:
            peaks[r["deployment"]] = (r["goodput"][slo], r["rate"])
    if not peaks:
        return None
    top = max(g for g, _ in peaks.values())
    winners = [d for d, (g, _) in peaks.items() if abs(g - top) < 1e-9]
    return " = ".join(winners), top, min(peaks[d][1] for d in winners)


def write_summary(runs: list[dict], cfg, out: Path) -> Path:
    slo_names = [name for name, _ in cfg.slos]
    lines = [f"# Experiment {cfg.name}", ""]
    for name, slo in cfg.slos:
        lines.append(f"- SLO `{name}`: TTFT <= {slo.ttft_ms} ms, TPOT <= {slo.tpot_ms} ms")
    for workload, _ in cfg.workloads:
        lines += [
            "",
            f"## Workload `{workload}`",
            "",
            "| deployment | rate | ok | req/s | out tok/s | TTFT p50 | TTFT p90 | TPOT p50 | TPOT p90 | "
            + " | ".join(f"goodput {s}" for s in slo_names)
            + " |",
            "|" + "---|" * (9 + len(slo_names)),
        ]
        for r in (r for r in runs if r["workload"] == workload):
            s = r["summary"]
            lines.append(
                f"| {r['deployment']} | {r['rate']} | {s['num_ok']}/{s['num_requests']} | "
                f"{s['request_throughput']:.2f} | {s['output_throughput']:.1f} | {_ms(s['ttft_ms'], 'p50')} | "
                f"{_ms(s['ttft_ms'], 'p90')} | {_ms(s['tpot_ms'], 'p50')} | {_ms(s['tpot_ms'], 'p90')} | "
                + " | ".join(f"{r['goodput'][n]:.2f}" for n in slo_names)
                + " |"
            )
        lines.append("")
        for slo in slo_names:
            best = best_per_slo(runs, workload, slo)
            if best:
                lines.append(
                    f"- Best for SLO `{slo}`: **{best[0]}** (peak goodput {best[1]:.2f} req/s at {best[2]} req/s)"
                )
    path = out / "summary.md"
    path.write_text("\n".join(lines) + "\n")
    return path
