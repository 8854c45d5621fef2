"""PNG plots of an experiment (matplotlib, Agg backend: no display needed)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)

from splitserve.experiments.stats import RequestRecord  # noqa: E402


def _series(runs: list[dict], workload: str):
    by_dep: dict[str, list[dict]] = {}
    for run in runs:
        if run["workload"] == workload:
            by_dep.setdefault(run["deployment"], []).append(run)
    return {dep: sorted(rs, key=lambda r: r["rate"]) for dep, rs in by_dep.items()}


def _percentile_plot(runs, workload: str, metric: str, label: str, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for dep, rs in _series(runs, workload).items():
        rates = [r["rate"] for r in rs]
        for q, style in (("p50", "-o"), ("p90", "--s")):
            ax.plot(rates, [r["summary"][metric][q] or float("nan") for r in rs], style, label=f"{dep} {q}")
    ax.set(xlabel="request rate (req/s)", ylabel=f"{label} (ms)", title=f"{label} vs rate ({workload})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _goodput_plot(runs, workload: str, slo_names: list[str], path: Path) -> None:
    fig, axes = plt.subplots(1, len(slo_names), figsize=(6 * len(slo_names), 4.5), squeeze=False)
    for ax, slo in zip(axes[0], slo_names):
        for dep, rs in _series(runs, workload).items():
            ax.plot([r["rate"] for r in rs], [r["goodput"][slo] for r in rs], "-o", label=dep)
        ax.set(xlabel="request rate (req/s)", ylabel="goodput (req/s)", title=f"goodput, SLO {slo} ({workload})")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _cdf_plot(runs, workload: str, path: Path) -> None:
    """TTFT and TPOT CDFs of each deployment at its highest rate."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for dep, rs in _series(runs, workload).items():
        top = rs[-1]
        ok = [rec for rec in (RequestRecord(**r) for r in top["records"]) if rec.ok]
        ttft = sorted(r.ttft_s * 1e3 for r in ok if r.ttft_s is not None)
        tpot = sorted(t * 1e3 for r in ok if (t := r.tpot_s) is not None)
        for ax, values in ((axes[0], ttft), (axes[1], tpot)):
            if values:
                ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=f"{dep} @ {top['rate']}")
    for ax, name in zip(axes, ("TTFT (ms)", "TPOT (ms)")):
        ax.set(xlabel=name, ylabel="fraction of requests", title=f"{name} CDF ({workload})")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_plots(runs: list[dict], cfg, out: Path) -> list[Path]:
    paths = []
    slo_names = [name for name, _ in cfg.slos]
    for workload, _ in cfg.workloads:
        stem = out / workload.replace("/", "_").replace(" ", "_")
        for metric, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E")):
            path = Path(f"{stem}-{metric.removesuffix('_ms')}_vs_rate.png")
            _percentile_plot(runs, workload, metric, label, path)
            paths.append(path)
        paths.append(Path(f"{stem}-goodput_vs_rate.png"))
        _goodput_plot(runs, workload, slo_names, paths[-1])
        paths.append(Path(f"{stem}-latency_cdf.png"))
        _cdf_plot(runs, workload, paths[-1])
    return paths
