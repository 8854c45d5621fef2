"""`splitserve bench` against a running tiny-model system, and a tiny `splitserve experiment` end to
end (two deployments, two rates) that writes its report folder and plots."""

from __future__ import annotations

import json

import pytest
from cluster_helpers import engine_argv

from splitserve.__main__ import main
from splitserve.experiments.experiment import load_config, run_experiment
from splitserve.services.launcher.launcher import start_cluster, stop_cluster


@pytest.fixture(scope="module")
def system(tiny_llama_dir):
    children = start_cluster(1, engine_argv(tiny_llama_dir))
    try:
        yield children
    finally:
        stop_cluster(children)


@pytest.mark.parametrize("arrival", ["poisson", "concurrency"])
def test_bench_reports_every_request(system, tmp_path, arrival, capsys):
    out = tmp_path / "bench.json"
    rc = main(
        [
            "bench",
            "--url",
            system[0].address,
            "--num-requests",
            "12",
            "--arrival",
            arrival,
            "--rate",
            "20",
            "--concurrency",
            "3",
            "--prompt-len",
            "uniform:4:60",
            "--output-len",
            "normal:8:2",
            "--shared-prefix-fraction",
            "0.5",
            "--prefix-len",
            "16",
            "--vocab-size",
            "300",
            "--slo",
            "ttft_ms=60000,tpot_ms=60000",
            "--json",
            str(out),
            "--no-progress",
        ]
    )
    assert rc == 0
    table = capsys.readouterr().out
    assert "12/12 ok" in table and "TTFT" in table and "goodput" in table
    report = json.loads(out.read_text())
    s = report["summary"]
    assert s["num_ok"] == 12 and s["errors"] == {} and s["slo_attainment"] == 1.0
    for metric in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
        assert s[metric]["p50"] > 0 and s[metric]["p99"] >= s[metric]["p50"], metric
    assert len(report["requests"]) == 12
    assert all(r["e2e_s"] >= r["ttft_s"] > 0 for r in report["requests"])
    assert report["settings"]["workload"]["arrival"] == arrival


def test_tiny_experiment_writes_report_and_plots(tiny_llama_dir, tmp_path):
    """Two deployments, two rates, two repeats of 1.5 s each with 0.25 s warm-up and cool-down excluded."""
    argv = json.dumps(engine_argv(tiny_llama_dir))
    config = tmp_path / "tiny.toml"
    config.write_text(f"""
name = "tiny"
engine_args = {argv}
warmup_requests = 1
[[slos]]
name = "loose"
ttft_ms = 60000
tpot_ms = 60000
[[slos]]
name = "impossible"
ttft_ms = 0.001
[[deployments]]
name = "unified x1"
workers = 1
pin_cpus = true
[[deployments]]
name = "1P1D"
prefill = 1
decode = 1
[sweep]
rates = [4.0, 8.0]
repeats = 2
duration_s = 1.5
warmup_s = 0.25
cooldown_s = 0.25
[[workloads]]
name = "short"
prompt_len = "uniform:8:40"
output_len = "6"
vocab_high = 300
""")
    out = tmp_path / "report"
    runs = run_experiment(load_config(config), out)
    assert [(r["deployment"], r["rate"], r["repeat"]) for r in runs] == [
        (dep, rate, repeat) for dep in ("unified x1", "1P1D") for repeat in (0, 1) for rate in (4.0, 8.0)
    ]
    for r in runs:
        sent = [rec["start_s"] for rec in r["records"]]
        assert r["summary"]["num_ok"] == len(sent) and max(sent) < 1.5 + 0.1  # sized by duration
        counted = sum(0.25 <= t <= 1.25 for t in sent)
        assert r["stats"]["num_counted"] == counted < len(sent)  # the first send (t = 0) is never counted
        assert r["stats"]["realised_rate"] == pytest.approx(counted / 1.0)
        assert r["goodput"]["impossible"] == 0 and r["goodput"]["loose"] == pytest.approx(counted / 1.0)
    assert runs[0]["seed"] == runs[4]["seed"] != runs[2]["seed"]  # same load for each deployment, fresh per repeat
    assert runs[0]["cpu_sets"] and runs[4]["cpu_sets"] is None
    saved = json.loads((out / "runs.json").read_text())
    assert len(saved["runs"]) == 8 and saved["settings"]["config"]["name"] == "tiny"
    points = saved["analysis"]["points"]
    assert len(points) == 4 and all(
        p["realised_rate"]["n"] == 2 and p["realised_rate"]["lo"] is not None for p in points
    )
    knees = {(k["deployment"], k["slo"]): k for k in saved["analysis"]["knees"]}
    assert knees[("unified x1", "loose")]["result"]["goodput"] == 8.0  # every rate met it: the top of the grid
    assert knees[("1P1D", "loose")]["per_worker"]["goodput"] == 4.0  # two workers
    assert knees[("1P1D", "impossible")]["result"]["goodput"] == 0.0
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert pngs == sorted(
        f"short-{n}.png"
        for n in (
            "ttft_vs_rate",
            "tpot_vs_rate",
            "itl_vs_rate",
            "e2e_vs_rate",
            "attainment_vs_rate",
            "goodput_vs_rate",
            "latency_cdf",
        )
    )
    assert all((out / p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)
    summary = (out / "summary.md").read_text()
    assert "### Goodput, SLO `loose`" in summary and "| 1P1D | 8.0 |" in summary
    # Every attainment is 100% (loose) or 0% (impossible) with zero spread: the intervals touch.
    assert "not distinguishable at this rate: 1P1D, unified x1" in summary


def test_an_autoscaled_deployment_records_its_workers_and_the_planners_decisions(tiny_llama_dir, tmp_path):
    """The planner in process for one 1.5 s run of one unified worker it may not grow (min = max): decisions
    every 0.5 s, the workers sampled into a timeline, goodput per worker-second, the comparison in the report."""
    config = tmp_path / "autoscaled.toml"
    config.write_text(f"""
name = "autoscaled"
engine_args = {json.dumps(engine_argv(tiny_llama_dir))}
warmup_requests = 1
[[slos]]
name = "loose"
ttft_ms = 60000
tpot_ms = 60000
[[deployments]]
name = "planner"
[deployments.autoscale]
ttft_ms = 0.001
itl_ms = 0.001
colocated = true
max_workers = 1
budget = 1
interval_s = 0.5
up_intervals = 1
[sweep]
rates = [4.0]
duration_s = 1.5
warmup_s = 0.25
cooldown_s = 0.25
[[workloads]]
name = "short"
prompt_len = "uniform:8:40"
output_len = "6"
vocab_high = 300
""")
    out = tmp_path / "report"
    (run,) = run_experiment(load_config(config), out)
    timeline = run["workers"]["timeline"]
    assert timeline[0] == [0.0, {"unified": 1}] and all(counts == {"unified": 1} for _, counts in timeline)
    assert run["workers"]["worker_seconds"] == pytest.approx(1.0) and run["workers"]["mean"] == pytest.approx(1.0)
    met = run["stats"]["slos"]["loose"]["num_met"]
    assert met == run["stats"]["num_counted"] and run["goodput_per_worker_second"]["loose"] == pytest.approx(met)
    decisions = [d for d in run["planner"] if d["event"] == "decision"]
    assert any(d["tiers"]["unified"]["reason"] == "max_workers" for d in decisions)  # over target, at its max
    assert all(d["scale"] == "unchanged" for d in decisions)
    assert (out / "short-workers_over_time.png").exists()
    assert "### Fixed layouts vs the planner, SLO `loose`" in (out / "summary.md").read_text()
