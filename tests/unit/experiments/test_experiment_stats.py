"""The experiment's statistics on synthetic records and curves with known answers: attainment per objective,
the measurement window, intervals over repeats, overlap, DistServe's goodput search, goodput per worker,
the config's sweeps; and a whole `splitserve experiment` (P:D sweep, search, report) against a fake server."""

from __future__ import annotations

import json
import math
import random
from contextlib import contextmanager
from dataclasses import replace

import pytest

from splitserve.experiments.analysis import compare, compare_knees, pd_grid
from splitserve.experiments.config import Deployment, ExperimentConfig, PDSweep, SweepConfig, load_config
from splitserve.experiments.experiment import Started, planned_span, run_experiment, run_seed, sized
from splitserve.experiments.goodput import GoodputResult, RateProbe, SearchConfig, bracket, search_goodput
from splitserve.experiments.intervals import Interval, bootstrap_interval, overlaps, t_975, t_interval
from splitserve.experiments.stats import SLO, RequestRecord, Window, run_stats
from splitserve.experiments.workload import LengthDist, WorkloadConfig, arrival_offsets


def _record(ttft: float, tpot: float, num_tokens: int = 3, start_s: float = 0.0, code: str = "OK") -> RequestRecord:
    times = [ttft + i * tpot for i in range(num_tokens)]
    return RequestRecord(10, num_tokens, code=code, ttft_s=ttft, token_times_s=times, e2e_s=times[-1], start_s=start_s)


# --- attainment and the measurement window


def test_attainment_of_each_objective_counts_failures_as_missed():
    records = [
        _record(0.2, 0.05, start_s=0.0),  # meets both
        _record(0.2, 0.2, start_s=1.0),  # TTFT only
        _record(0.9, 0.05, start_s=2.0),  # TPOT only
        _record(0.1, 0.0, num_tokens=1, start_s=3.0),  # one token: no TPOT to miss: both
        RequestRecord(10, 5, code="UNAVAILABLE", start_s=4.0),  # failed: meets neither
    ]
    stats = run_stats(records, 1.0, [("a", SLO(500, 100, attainment=0.4)), ("b", SLO(500, 100))], planned_s=5.0)
    a = stats.slos["a"]
    assert (a.ttft, a.tpot, a.both) == (3 / 5, 3 / 5, 2 / 5)
    assert stats.num_counted == stats.num_sent == 5 and stats.realised_rate == pytest.approx(5 / 5.0)
    assert a.met_rate == pytest.approx(2 / 5.0)
    assert a.passed and a.distserve_goodput == 1.0  # 40% >= 40%
    assert not stats.slos["b"].passed and stats.slos["b"].distserve_goodput == 0.0  # 40% < 90%
    json.dumps(stats.to_dict())


def test_window_drops_exactly_the_warm_up_and_cool_down_sends():
    records = [_record(0.1, 0.01, start_s=0.5 * i) for i in range(20)]  # sent at 0, 0.5, ..., 9.5
    window = Window(warmup_s=2.0, cooldown_s=3.0)
    counted = window.counted(records, planned_s=10.0)  # [2, 7], both ends in
    assert [r.start_s for r in counted] == [2.0 + 0.5 * i for i in range(11)]
    stats = run_stats(records, 2.0, [("s", SLO(500, 100))], window, planned_s=10.0)
    assert (stats.num_sent, stats.num_counted, stats.window_s) == (20, 11, 5.0)
    assert stats.realised_rate == pytest.approx(11 / 5.0)
    # Sized by count: the span is the last send (9.5), so the window is [2, 6.5].
    assert len(window.counted(records, planned_s=None)) == 10
    # A send late by scheduling jitter still counts without a cool-down.
    late = [*records, _record(0.1, 0.01, start_s=10.02)]
    assert len(Window(0.0, 0.0).counted(late, planned_s=10.0)) == 21
    with pytest.raises(ValueError, match="no measurement window"):
        Window(6.0, 4.0).bounds(records, planned_s=10.0)


def test_requests_meeting_the_slo_per_second_never_exceed_the_realised_rate():
    rng = random.Random(3)
    for _ in range(200):
        n = rng.randint(1, 30)
        records = [_record(rng.uniform(0, 1), rng.uniform(0, 0.2), start_s=rng.uniform(0, 10)) for _ in range(n)]
        stats = run_stats(records, 3.0, [("s", SLO(rng.uniform(0, 1000), 100))], Window(1.0, 1.0), planned_s=10.0)
        assert stats.slos["s"].met_rate <= stats.realised_rate
        assert 0.0 <= stats.slos["s"].both <= min(stats.slos["s"].ttft, stats.slos["s"].tpot) <= 1.0


# --- intervals


def test_t_interval_against_a_hand_computed_one():
    i = t_interval([0.8, 0.9, 1.0])  # mean 0.9, s = 0.1, t(0.975, 2) = 4.3027
    half = 4.3027 * 0.1 / math.sqrt(3)
    assert (i.mean, i.n, i.method) == (pytest.approx(0.9), 3, "t")
    assert i.lo == pytest.approx(0.9 - half) and i.hi == pytest.approx(0.9 + half)
    assert t_interval([0.8, 0.9, 1.0], bounds=(0.0, 1.0)).hi == 1.0
    assert t_interval([0.7]) == Interval(0.7, None, None, 1, "t")  # one repeat: no interval
    assert t_interval([2.0, 2.0, 2.0]).lo == t_interval([2.0, 2.0, 2.0]).hi == 2.0
    for df, exact in ((1, 12.7062), (10, 2.2281), (40, 2.0211), (120, 1.9799)):
        assert t_975(df) == pytest.approx(exact, abs=2e-4)


def test_bootstrap_interval_is_seeded_and_agrees_with_t_for_many_samples():
    samples = [1.0, 2.0, 3.0, 4.0, 5.0]
    b = bootstrap_interval(samples)
    assert b == bootstrap_interval(samples) and b.method == "bootstrap"
    assert 1.0 <= b.lo < 3.0 < b.hi <= 5.0
    assert bootstrap_interval([0.5, 0.5]).lo == 0.5
    rng = random.Random(1)
    many = [rng.gauss(10, 2) for _ in range(200)]
    t, boot = t_interval(many), bootstrap_interval(many)
    assert boot.hi - boot.lo == pytest.approx(t.hi - t.lo, rel=0.15)


def test_overlap_decides_what_can_be_told_apart():
    a = Interval(1.0, 0.5, 1.5, 3, "t")
    assert overlaps(a, Interval(2.0, 1.4, 2.6, 3, "t"))
    assert overlaps(a, Interval(2.0, 1.5, 2.5, 3, "t"))  # touching: not told apart
    assert not overlaps(a, Interval(2.0, 1.6, 2.4, 3, "t"))
    assert overlaps(a, Interval(5.0, None, None, 1, "t"))  # a single run is told apart from nothing
    verdict = compare([("a", a), ("b", Interval(2.0, 1.4, 2.6, 3, "t")), ("c", Interval(0.1, 0.0, 0.2, 3, "t"))],
                      lambda i: i.mean, overlaps)  # fmt: skip
    assert verdict.leaders == ("b", "a") and verdict.others == ("c",) and verdict.winner is None
    verdict = compare([("a", a), ("c", Interval(0.1, 0.0, 0.2, 3, "t"))], lambda i: i.mean, overlaps)
    assert verdict.winner == "a"


# --- DistServe goodput search


def _curve(attainment_of):
    """A probe over a noise-free attainment curve (three equal repeats), recording the rates asked for."""
    asked = []

    def probe(rate: float) -> list[float]:
        asked.append(rate)
        return [attainment_of(rate)] * 3

    return probe, asked


def test_search_bisects_a_step_curve_to_its_knee():
    probe, asked = _curve(lambda r: 1.0 if r <= 3.3 else 0.5)
    result = search_goodput(probe, [1.0, 2.0, 4.0], 0.9, SearchConfig(tolerance=0.05, max_probes=10))
    assert asked == [1.0, 2.0, 4.0, 3.0, 3.5, 3.25, 3.375]  # stops once 3.375 <= 3.25 * 1.05
    assert (result.goodput, result.ceiling, result.converged) == (3.25, 3.375, True)
    # Noise-free repeats: every interval is a point, so the range is the bracket.
    assert (result.range_lo, result.range_hi) == (3.25, 3.375)


def test_search_finds_the_knee_of_a_linear_curve_within_tolerance():
    probe, _ = _curve(lambda r: 1.0 - 0.1 * r)  # 90% at exactly 1.0 req/s
    result = search_goodput(probe, [0.5, 4.0], 0.9, SearchConfig(tolerance=0.02, max_probes=20))
    assert result.converged and result.goodput <= 1.0 < result.ceiling <= result.goodput * 1.02


def test_search_expands_the_bracket_and_stops_at_max_probes():
    probe, asked = _curve(lambda r: 1.0 if r <= 10 else 0.0)
    result = search_goodput(probe, [1.0, 2.0], 0.9, SearchConfig(max_probes=3))
    assert asked == [1.0, 2.0, 4.0, 8.0, 16.0] and (result.goodput, result.ceiling, result.converged) == (8, 16, False)
    probe, asked = _curve(lambda r: 1.0 if r <= 1.0 else 0.0)
    assert search_goodput(probe, [4.0], 0.9, SearchConfig(max_probes=2)).goodput == 1.0 and asked == [4.0, 2.0, 1.0]
    probe, _ = _curve(lambda r: 0.0)  # an SLO nothing meets
    nothing = search_goodput(probe, [1.0, 2.0], 0.9, SearchConfig(max_probes=2))
    assert (nothing.goodput, nothing.ceiling) == (0.0, 0.25)
    probe, asked = _curve(lambda r: 1.0)
    assert search_goodput(probe, [1.0, 2.0], 0.9).ceiling is None and asked == [1.0, 2.0]  # max_probes 0: grid only


def test_passing_rates_above_a_failing_one_are_not_believed():
    probes = [
        RateProbe(1.0, t_interval([1.0, 1.0]), True),
        RateProbe(2.0, t_interval([0.5, 0.5]), False),
        RateProbe(3.0, t_interval([1.0, 1.0]), True),
    ]
    assert bracket(probes) == (1.0, 2.0)


def test_goodput_range_from_noisy_repeats_and_per_worker():
    samples = {1.0: [1.0, 0.99, 1.0], 2.0: [0.95, 0.85, 0.92], 3.0: [0.5, 0.55, 0.6]}
    result = search_goodput(lambda r: samples[r], samples, 0.9)
    assert (result.goodput, result.ceiling) == (2.0, 3.0)
    # 2.0 passes on its mean but its interval reaches below 90%: surely served up to 1.0, surely not from 3.0.
    assert (result.range_lo, result.range_hi) == (1.0, 3.0)
    half = result.per_worker(2)
    assert (half.goodput, half.ceiling, half.range_lo, half.range_hi) == (1.0, 1.5, 0.5, 1.5)
    with pytest.raises(ValueError, match="at least one worker"):
        result.per_worker(0)
    one_repeat = search_goodput(lambda r: samples[r][:1], samples, 0.9)
    assert (one_repeat.range_lo, one_repeat.range_hi) == (0.0, None)  # nothing is sure from one run
    assert result.range_overlaps(one_repeat) and not result.range_overlaps(GoodputResult(5.0, 6.0, 4.0, 6.0, True, ()))


def test_goodput_per_worker_divides_by_workers_or_gpus():
    assert Deployment("u", workers=2).budget == 2 and Deployment("pd", prefill=1, decode=1).budget == 2
    assert Deployment("e", endpoint="http://h:8000").budget == 1
    assert Deployment("e4", endpoint="http://h:8000", gpus=4).budget == 4


# --- config: sweep, run sizing, P:D sweep


def test_sweep_settings_are_checked():
    with pytest.raises(ValueError, match="repeats"):
        SweepConfig((1.0,), repeats=0)
    with pytest.raises(ValueError, match="leaves nothing to count"):
        SweepConfig((1.0,), duration_s=10, warmup_s=5, cooldown_s=5)
    with pytest.raises(ValueError, match="interval"):
        SweepConfig((1.0,), interval="normal")
    with pytest.raises(ValueError, match="positive"):
        SweepConfig((0.0,))
    with pytest.raises(ValueError, match="tolerance"):
        SearchConfig(tolerance=0.0)


def test_runs_sized_by_duration_send_poisson_arrivals_for_the_whole_duration():
    chat = WorkloadConfig(num_requests=4, rate=2.0)
    run = sized(chat, 30.0)
    assert run.duration_s == 30.0 and run.num_requests >= 60 + 8 * math.sqrt(60) and planned_span(run) == 30.0
    assert max(arrival_offsets(run, run.num_requests)) > 30.0  # enough requests: the duration cuts, not the count
    assert sized(replace(chat, duration_s=5.0), 30.0).duration_s == 5.0  # the workload's own duration wins
    assert sized(chat, None) == chat and planned_span(chat) is None  # sized by count
    closed = WorkloadConfig(arrival="concurrency")
    assert sized(closed, 30.0) == closed
    seeds = {run_seed(0, rate, repeat) for rate in (0.5, 1.0, 2.0) for repeat in range(3)}
    assert len(seeds) == 9 and run_seed(0, 0.5, 1) == run_seed(0, 0.5, 1)


def test_pd_sweep_splits_a_budget_and_rescales_prompts(tmp_path):
    pd = PDSweep(budget=3, prompt_output_ratios=(1, 4), pin_cpus=True)
    assert [d.name for d in pd.layouts()] == ["unified x3", "1P2D", "2P1D"]
    assert [(d.prefill, d.decode, d.workers, d.budget) for d in pd.layouts()] == [
        (0, 0, 3, 3),
        (1, 2, 0, 3),
        (2, 1, 0, 3),
    ]
    base = WorkloadConfig(prompt_len=LengthDist.parse("uniform:128:384"), output_len=LengthDist.parse("uniform:16:48"))
    (n1, w1), (n4, w4) = pd.workloads("chat", base)
    assert (n1, n4) == ("chat 1:1", "chat 4:1")
    assert (w1.prompt_len, w4.prompt_len) == (LengthDist("uniform", 16, 48), LengthDist("uniform", 64, 192))
    assert w1.output_len == base.output_len
    ((_, decode_heavy),) = PDSweep(budget=2, prompt_output_ratios=(0.25,)).workloads("chat", base)
    assert decode_heavy.prompt_len == LengthDist("uniform", 4, 12)  # mean 8 = 32 / 4
    config = tmp_path / "pd.toml"
    config.write_text("""
[[deployments]]
name = "1P1D"
prefill = 1
decode = 1
[sweep]
rates = [1, 2]
[pd_sweep]
budget = 2
prompt_output_ratios = [2]
[[workloads]]
name = "chat"
output_len = "32"
""")
    plan = load_config(config).plan()  # the listed 1P1D is the layout: started once, runs both workloads
    assert [(d.name, [w for w, _ in ws]) for d, ws in plan] == [
        ("1P1D", ["chat", "chat 2:1"]),
        ("unified x2", ["chat 2:1"]),
    ]
    assert load_config(config).rates == (1.0, 2.0)
    config.write_text(config.read_text().replace("decode = 1\n", "decode = 1\npin_cpus = true\n", 1))
    with pytest.raises(ValueError, match="differs from the"):
        load_config(config)


# --- a whole experiment against a fake server


def _fake_start(cfg: ExperimentConfig, dep: Deployment):
    """A server whose TTFT grows once the offered rate per worker passes a capacity (more for prefill-heavy
    layouts at long prompts), with seeded noise: known shape, different numbers per repeat."""

    @contextmanager
    def started():
        def send(w: WorkloadConfig, show_progress: bool):
            rng = random.Random(w.seed)
            capacity = dep.budget * (1.0 + 0.2 * dep.prefill) * 32 / max(32.0, w.prompt_len.a)
            offsets = [t for t in arrival_offsets(w, w.num_requests) or [] if w.duration_s is None or t < w.duration_s]
            ttft = 0.05 + max(0.0, w.rate - capacity)
            records = [_record(ttft * rng.uniform(0.9, 1.1), 0.02, start_s=t) for t in offsets]
            return records, (offsets[-1] if offsets else 0.0) + 1.0

        yield Started(send)

    return started()


def test_a_whole_experiment_with_a_pd_sweep_writes_its_report(tmp_path):
    config = tmp_path / "fake.toml"
    config.write_text("""
name = "fake"
warmup_requests = 0
[[slos]]
name = "tight"
ttft_ms = 300
tpot_ms = 100
attainment = 0.9
[[deployments]]
name = "unified x1"
workers = 1
[sweep]
rates = [0.5, 1.0, 2.0]
repeats = 3
duration_s = 40
warmup_s = 5
cooldown_s = 5
[goodput]
tolerance = 0.1
max_probes = 3
[pd_sweep]
budget = 2
prompt_output_ratios = [1, 4]
[[workloads]]
name = "chat"
prompt_len = "32"
output_len = "32"
""")
    cfg = load_config(config)
    out = tmp_path / "report"
    runs = run_experiment(cfg, out, start=_fake_start)
    first = [(r["rate"], r["repeat"]) for r in runs if r["deployment"] == "unified x1"][:6]
    assert first == [(0.5, 0), (1.0, 0), (2.0, 0), (0.5, 1), (1.0, 1), (2.0, 1)]  # repeat by repeat
    assert all(r["stats"]["num_counted"] < r["stats"]["num_sent"] for r in runs)
    for r in runs:  # counted: exactly the sends within [warmup_s, duration_s - cooldown_s]
        assert r["stats"]["num_counted"] == sum(5.0 <= rec["start_s"] <= 35.0 for rec in r["records"])
    saved = json.loads((out / "runs.json").read_text())
    knees = {(k["deployment"], k["workload"]): k for k in saved["analysis"]["knees"]}
    assert set(knees) == {("unified x1", "chat"), ("unified x2", "chat 1:1"), ("unified x2", "chat 4:1"),
                          ("1P1D", "chat 1:1"), ("1P1D", "chat 4:1")}  # fmt: skip
    # unified x1 at these prompts: TTFT 0.05 + (rate - 1) s, times 0.9-1.1; 90% meet 300 ms up to 1.228 req/s.
    # The grid brackets it in [1, 2), the three extra probes narrow that to [1.125, 1.25).
    unified = knees[("unified x1", "chat")]["result"]
    assert [p["rate"] for p in unified["probes"]] == [0.5, 1.0, 2.0, 1.5, 1.25, 1.125]
    assert (unified["goodput"], unified["ceiling"], unified["converged"]) == (1.125, 1.25, False)
    analysis_layouts, ratios, grid = pd_grid(_reanalyse(saved, cfg), cfg, "tight")
    assert analysis_layouts == ["unified x2", "1P1D"] and ratios == ["chat 1:1", "chat 4:1"]
    assert all(v is not None and v > 0 for row in grid for v in row)
    pngs = {p.name for p in out.glob("*.png")}
    assert "pd_sweep-goodput_per_worker.png" in pngs and "chat-attainment_vs_rate.png" in pngs
    assert "chat_4-1-goodput_vs_rate.png" in pngs
    summary = (out / "summary.md").read_text()
    assert "## P:D layouts at a budget of 2 workers" in summary and "95% t-intervals" in summary
    assert "### By offered rate, SLO `tight`" in summary and "| unified x1 | 0.5 |" in summary
    assert "not distinguishable" in summary or "has the highest" in summary


def _reanalyse(saved: dict, cfg: ExperimentConfig):
    """The analysis again from runs.json alone: the report can be rebuilt without rerunning anything."""
    from splitserve.experiments.analysis import analyze

    analysis = analyze(saved["runs"], cfg)
    assert [k.result.goodput for k in analysis.knees] == [k["result"]["goodput"] for k in saved["analysis"]["knees"]]
    assert compare_knees(analysis.knees_of("chat 1:1", "tight")).leaders
    return analysis


def test_a_run_that_counted_nobody_is_no_evidence():
    from splitserve.experiments.stats import attainment_samples

    def run(counted: int, both: float) -> dict:
        return {"num_counted": counted, "slos": {"s": {"both": both, "ttft": both, "tpot": both}}}

    # A low rate whose window saw no arrival in one repeat: that repeat does not pull the mean to 0.
    assert attainment_samples([run(3, 1.0), run(0, 0.0)], "s") == [1.0]
    assert attainment_samples([run(0, 0.0), run(0, 0.0)], "s") == [0.0]  # no evidence at all: not served
    assert attainment_samples([run(2, 0.5), run(4, 1.0)], "s", "tpot") == [0.5, 1.0]


def test_intervals_of_rates_stay_non_negative():
    """Realised rates and goodput are never negative; a t-interval over two far-apart repeats (t = 12.7)
    reached below 0 in the reports, a value no rate can take."""
    from splitserve.experiments.analysis import point

    def repeat(realised: float, met: float) -> dict:
        slo = {"both": 1.0, "ttft": 1.0, "tpot": 1.0, "met_rate": met}
        stats = {"num_sent": 10, "num_counted": 8, "realised_rate": realised, "slos": {"s": slo}}
        return {"deployment": "1P1D", "workload": "chat", "rate": 0.5, "budget": 2, "stats": stats}

    p = point([repeat(0.2, 0.1), repeat(1.2, 1.0)], [("s", 0.9)], "t")
    intervals = [p.realised_rate, p.mean_workers, p.slos["s"].goodput_per_worker, p.slos["s"].goodput_per_worker_second]
    assert all(i.lo is not None and i.lo >= 0.0 for i in intervals)
    assert p.realised_rate.hi is not None and p.realised_rate.hi > 1.2  # only the impossible side is cut
