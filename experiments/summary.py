"""summary.md: one row per run, and the best deployment per SLO (highest peak goodput)."""

from __future__ import annotations

from pathlib import Path


def _ms(values: dict, q: str) -> str:
    v = values.get(q)
    return "-" if v is None else f"{v:.0f}"


def best_per_slo(runs: list[dict], workload: str, slo: str) -> tuple[str, float, float] | None:
    """(deployment, its peak goodput, the rate it was reached at) for one workload and SLO."""
    candidates = [(r["goodput"][slo], -r["rate"], r["deployment"]) for r in runs if r["workload"] == workload]
    if not candidates:
        return None
    goodput, neg_rate, dep = max(candidates)
    return dep, goodput, -neg_rate


def write_summary(runs: list[dict], cfg, out: Path) -> Path:
    slo_names = [name for name, _ in cfg.slos]
    lines = [f"# Experiment {cfg.name}", ""]
    for name, slo in cfg.slos:
        lines.append(f"- SLO `{name}`: TTFT <= {slo.ttft_ms} ms, TPOT <= {slo.tpot_ms} ms")
    for workload, _ in cfg.workloads:
        lines += ["", f"## Workload `{workload}`", "",
                  "| deployment | rate | ok | req/s | out tok/s | TTFT p50 | TTFT p90 | TPOT p50 | TPOT p90 | "
                  + " | ".join(f"goodput {s}" for s in slo_names) + " |",
                  "|" + "---|" * (9 + len(slo_names))]
        for r in (r for r in runs if r["workload"] == workload):
            s = r["summary"]
            lines.append(f"| {r['deployment']} | {r['rate']} | {s['num_ok']}/{s['num_requests']} | "
                         f"{s['request_throughput']:.2f} | {s['output_throughput']:.1f} | {_ms(s['ttft_ms'], 'p50')} | "
                         f"{_ms(s['ttft_ms'], 'p90')} | {_ms(s['tpot_ms'], 'p50')} | {_ms(s['tpot_ms'], 'p90')} | "
                         + " | ".join(f"{r['goodput'][n]:.2f}" for n in slo_names) + " |")
        lines.append("")
        for slo in slo_names:
            best = best_per_slo(runs, workload, slo)
            if best:
                lines.append(f"- Best for SLO `{slo}`: **{best[0]}** (peak goodput {best[1]:.2f} req/s at {best[2]} req/s)")
    path = out / "summary.md"
    path.write_text("\n".join(lines) + "\n")
    return path
