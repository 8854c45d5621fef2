"""PNG plots of an experiment (matplotlib, Agg backend: no display needed).

Per workload: latency percentiles vs offered rate (means over repeats), SLO attainment vs offered rate
(TTFT, TPOT, both; one row per SLO; the target as a horizontal line; interval error bars; each
deployment's DistServe goodput as a dotted vertical line), goodput per worker vs offered rate, and TTFT /
TPOT CDFs. With an autoscaled deployment: its live workers over each run (a panel per tier and one for
all, a line per rate, the fixed layouts' counts dashed, the measurement window shaded). With a
[pd_sweep]: one heat map of goodput per worker, layouts x prompt:output ratios.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)
from matplotlib.ticker import MaxNLocator  # noqa: E402

from splitserve.experiments.analysis import Analysis, Point, pd_grid  # noqa: E402
from splitserve.experiments.config import ExperimentConfig  # noqa: E402
from splitserve.experiments.fleet import WorkerTimeline  # noqa: E402
from splitserve.experiments.intervals import Interval  # noqa: E402
from splitserve.experiments.stats import RequestRecord  # noqa: E402


def _runs_by_deployment(runs: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for run in runs:
        out.setdefault(run["deployment"], []).append(run)
    return out


def _points_by_deployment(points: list[Point]) -> dict[str, list[Point]]:
    out: dict[str, list[Point]] = {}
    for p in points:  # analysis.points_of: sorted by rate within each deployment
        out.setdefault(p.deployment, []).append(p)
    return out


def _save(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _errorbar(ax, rates: list[float], intervals: list[Interval], **style) -> None:
    """Means with their intervals as error bars (none for a single repeat)."""
    means = [i.mean for i in intervals]
    below = [i.mean - i.lo if i.lo is not None else 0.0 for i in intervals]
    above = [i.hi - i.mean if i.hi is not None else 0.0 for i in intervals]
    ax.errorbar(rates, means, yerr=[below, above], capsize=3, **style)


def _percentile_plot(runs: list[dict], metric: str, label: str, title: str, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for dep, rs in _runs_by_deployment(runs).items():
        rates = sorted({r["rate"] for r in rs})
        for q, style in (("p50", "-o"), ("p90", "--s")):
            values = [[r["summary"][metric][q] for r in rs if r["rate"] == rate] for rate in rates]
            means = [sum(v) / len(v) if None not in v else float("nan") for v in values]
            ax.plot(rates, means, style, label=f"{dep} {q}")
    ax.set(xlabel="offered rate (req/s)", ylabel=f"{label} (ms, mean over repeats)", title=f"{label} vs rate ({title})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    _save(fig, path)


def _attainment_plot(analysis: Analysis, cfg: ExperimentConfig, workload: str, path: Path) -> None:
    slos = cfg.slos
    fig, axes = plt.subplots(len(slos), 3, figsize=(15, 4.2 * len(slos)), squeeze=False)
    points = _points_by_deployment(analysis.points_of(workload))
    for row, (slo, objectives) in zip(axes, slos):
        for ax, part in zip(row, ("ttft", "tpot", "both")):
            for n, (dep, ps) in enumerate(points.items()):
                intervals = [getattr(p.slos[slo], part) for p in ps]
                _errorbar(ax, [p.rate for p in ps], intervals, fmt="-o", color=f"C{n}", label=dep)
                knee = analysis.knee(dep, workload, slo)
                if part == "both" and knee is not None and knee.result.goodput:
                    ax.axvline(knee.result.goodput, color=f"C{n}", linestyle=":", alpha=0.7)
            ax.axhline(objectives.attainment, color="black", linestyle="--", linewidth=1, label="target")
            what = {"ttft": "TTFT met", "tpot": "TPOT met", "both": "both met (SLO attainment)"}[part]
            ax.set(xlabel="offered rate (req/s)", ylabel="share of counted requests", ylim=(-0.03, 1.03))
            ax.set_title(f"{what}, SLO {slo} ({workload})", fontsize=10)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    _save(fig, path)


def _goodput_plot(analysis: Analysis, cfg: ExperimentConfig, workload: str, path: Path) -> None:
    slo_names = [name for name, _ in cfg.slos]
    fig, axes = plt.subplots(1, len(slo_names), figsize=(6 * len(slo_names), 4.5), squeeze=False)
    points = _points_by_deployment(analysis.points_of(workload))
    for ax, slo in zip(axes[0], slo_names):
        for dep, ps in points.items():
            _errorbar(ax, [p.rate for p in ps], [p.slos[slo].goodput_per_worker for p in ps], fmt="-o", label=dep)
        ax.set(xlabel="offered rate (req/s)", ylabel="req/s meeting the SLO, per worker")
        ax.set_title(f"goodput per worker, SLO {slo} ({workload})", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    _save(fig, path)


def _cdf_plot(runs: list[dict], rates: tuple[float, ...], workload: str, path: Path) -> None:
    """TTFT and TPOT CDFs of each deployment at its highest grid rate, all repeats pooled."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for dep, rs in _runs_by_deployment(runs).items():
        top = max((r["rate"] for r in rs if r["rate"] in rates), default=max(r["rate"] for r in rs))
        ok = [rec for r in rs if r["rate"] == top for rec in map(lambda d: RequestRecord(**d), r["records"]) if rec.ok]
        ttft = sorted(r.ttft_s * 1e3 for r in ok if r.ttft_s is not None)
        tpot = sorted(t * 1e3 for r in ok if (t := r.tpot_s) is not None)
        for ax, values in ((axes[0], ttft), (axes[1], tpot)):
            if values:
                ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=f"{dep} @ {top}")
    for ax, name in zip(axes, ("TTFT (ms)", "TPOT (ms)")):
        ax.set(xlabel=name, ylabel="fraction of requests", title=f"{name} CDF ({workload})")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    _save(fig, path)


def _workers_panel(ax, runs: list[dict], tier: str | None) -> None:
    """One tier's live workers (None: all tiers') over each run: a line per rate, its first repeat solid."""
    rates, most = sorted({r["rate"] for r in runs}), 1
    for r in runs:
        samples = WorkerTimeline.from_json(r["workers"]["timeline"]).samples
        counts = [sum(c.values()) if tier is None else c.get(tier, 0) for _, c in samples]
        first, most = r["repeat"] == 0, max(most, *counts)
        label = f"{r['rate']:g} req/s" if first else None
        color, alpha = f"C{rates.index(r['rate'])}", 1.0 if first else 0.4
        ax.step([t for t, _ in samples], counts, where="post", color=color, alpha=alpha, label=label)
    window = runs[0]["stats"]
    ax.axvspan(window["window_start_s"], window["window_end_s"], color="grey", alpha=0.12, label="measured")
    ax.set_ylim(0, most + 1)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set(xlabel="seconds from the run's first send", ylabel="live workers")
    ax.grid(alpha=0.3)


def _workers_plot(runs: list[dict], autoscaled: list[str], workload: str, path: Path) -> None:
    """A row per autoscaled deployment: a panel per tier it plans, then one of all its workers beside the
    fixed layouts' counts (dashed)."""
    by_dep = _runs_by_deployment(runs)
    fixed = {dep: round(rs[0]["workers"]["mean"]) for dep, rs in by_dep.items() if dep not in autoscaled}
    panels = {dep: [*_tiers(by_dep[dep]), None] for dep in autoscaled if dep in by_dep}
    num_columns = max(len(tiers) for tiers in panels.values())
    size = (4.8 * num_columns, 3.6 * len(panels))
    fig, axes = plt.subplots(len(panels), num_columns, figsize=size, squeeze=False)
    for (dep, tiers), row in zip(panels.items(), axes):
        for ax, tier in zip(row, tiers):
            _workers_panel(ax, by_dep[dep], tier)
            ax.set_title(f"{dep}: {tier or 'all workers'} ({workload})", fontsize=10)
        for n, (name, count) in enumerate(fixed.items()):
            style = ("--", ":", "-.")[n % 3]
            row[len(tiers) - 1].axhline(count, color="black", linestyle=style, alpha=0.5, label=f"{name}: {count}")
        for ax in row[: len(tiers)]:
            ax.legend(fontsize=7)
        for ax in row[len(tiers) :]:
            ax.set_visible(False)
    _save(fig, path)


def _tiers(runs: list[dict]) -> list[str]:
    """The tiers the runs' worker timelines count, in the order they appear."""
    return list(dict.fromkeys(t for r in runs for t in WorkerTimeline.from_json(r["workers"]["timeline"]).tiers()))


def _pd_heatmap(analysis: Analysis, cfg: ExperimentConfig, path: Path) -> None:
    assert cfg.pd_sweep is not None
    slo_names = [name for name, _ in cfg.slos]
    num_rows, num_columns = len(cfg.pd_sweep.layouts()), len(cfg.pd_workloads())
    size = (len(slo_names) * (3 + 1.4 * num_columns), 1.8 + 0.6 * num_rows)
    fig, axes = plt.subplots(1, len(slo_names), figsize=size, squeeze=False)
    for ax, slo in zip(axes[0], slo_names):
        layouts, workloads, values = pd_grid(analysis, cfg, slo)
        grid = [[float("nan") if v is None else v for v in row] for row in values]
        image = ax.imshow(grid, cmap="viridis", aspect="auto")
        for i, row in enumerate(values):
            for j, v in enumerate(row):
                light = v is not None and image.norm(v) > 0.6  # viridis is yellow at the top: dark text there
                text = "-" if v is None else f"{v:.3g}"
                ax.text(j, i, text, ha="center", va="center", color="black" if light else "white", fontsize=9)
        ax.set_xticks(range(len(workloads)), [w.rsplit(" ", 1)[-1] for w in workloads])
        ax.set_yticks(range(len(layouts)), layouts)
        ax.set(xlabel="prompt:output length ratio", ylabel="layout", title=f"goodput per worker (req/s), SLO {slo}")
        fig.colorbar(image, ax=ax)
    _save(fig, path)


def file_stem(workload: str) -> str:
    """How a workload's name starts its plots' file names."""
    return workload.replace("/", "_").replace(" ", "_").replace(":", "-")


def write_plots(runs: list[dict], analysis: Analysis, cfg: ExperimentConfig, out: Path) -> list[Path]:
    paths = []
    for workload in analysis.workloads():
        stem = out / file_stem(workload)
        wruns = [r for r in runs if r["workload"] == workload]
        for metric, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E")):
            paths.append(Path(f"{stem}-{metric.removesuffix('_ms')}_vs_rate.png"))
            _percentile_plot(wruns, metric, label, workload, paths[-1])
        paths.append(Path(f"{stem}-attainment_vs_rate.png"))
        _attainment_plot(analysis, cfg, workload, paths[-1])
        paths.append(Path(f"{stem}-goodput_vs_rate.png"))
        _goodput_plot(analysis, cfg, workload, paths[-1])
        paths.append(Path(f"{stem}-latency_cdf.png"))
        _cdf_plot(wruns, cfg.sweep.rates, workload, paths[-1])
        if any(r["deployment"] in cfg.autoscaled() for r in wruns):
            paths.append(Path(f"{stem}-workers_over_time.png"))
            _workers_plot(wruns, cfg.autoscaled(), workload, paths[-1])
    if cfg.pd_sweep is not None:
        paths.append(out / "pd_sweep-goodput_per_worker.png")
        _pd_heatmap(analysis, cfg, paths[-1])
    return paths
