"""The reader on /metrics texts rendered by the gateway's and the workers' own metric classes (no
processes), and the planner's own series."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from splitserve.common.roles import Role
from splitserve.gateway.metrics import GatewayMetrics
from splitserve.services.disagg.metrics import KVTransferMetrics
from splitserve.services.engine.step_stats import StepStats
from splitserve.services.planner.metrics import PlannerMetrics
from splitserve.services.planner.policy import Decision, Mode, Observation, Reason, TierDecision
from splitserve.services.planner.profile import LinearModel, OnlineFit, decode_features, prefill_features
from splitserve.services.planner.reader import Samples, Scrape, WorkerScrape, histogram_quantile, observe
from splitserve.services.worker.metrics import CoreMetrics, EngineSnapshot, RequestTiming, WorkerMetrics, metric_labels


class Worker:
    """A worker's metrics with an engine state the test sets."""

    def __init__(self, address: str, role: Role) -> None:
        self.address, self.role = address, role
        self.state = EngineSnapshot(0, 0, 0.0, 0, 0, 0)
        self.steps = StepStats()  # the engine's own step counters, fed by step()
        self.metrics = WorkerMetrics("tiny", role.value, lambda: replace(self.state, steps=self.steps.snapshot()))
        core = CollectorRegistry()  # its engine core's, exported with its own as a worker does
        self.kv = KVTransferMetrics(metric_labels("tiny", role.value), role.value, core)
        self.metrics.registry.register(CoreMetrics(lambda: generate_latest(core)))

    def step(self, seq_lens: list[int], query_lens: list[int], seconds: float, repeat: int = 1) -> None:
        """Steps as the engine counts them: each sequence at seq_len tokens after computing query_len."""
        ends, queries = np.array(seq_lens), np.array(query_lens)
        for _ in range(repeat):
            self.steps.record(ends - queries, queries, int(queries.sum()), seconds)

    def finish(self, n: int, prompt_tokens: int, output_tokens: int, prefill_s: float = 0.1) -> None:
        for _ in range(n):
            timing = RequestTiming(arrival=0.0, first_token=prefill_s, finished=prefill_s + 1.0)
            self.metrics.observe_finished(timing, prompt_tokens, output_tokens, "length")

    def scrape(self) -> WorkerScrape:
        return WorkerScrape(self.address, self.role, Samples.parse(generate_latest(self.metrics.registry).decode()))


def scrape(t: float, gateway: GatewayMetrics, *workers: Worker) -> Scrape:
    return Scrape(t, Samples.parse(generate_latest(gateway.registry).decode()), tuple(w.scrape() for w in workers))


def test_an_interval_of_a_disaggregated_system():
    gateway, prefill, decode = GatewayMetrics(), Worker("p0", Role.PREFILL), Worker("d0", Role.DECODE)
    gateway.requests.labels(code="OK").inc(7)  # before the interval: not counted
    gateway.pending.set(3)
    first = scrape(100.0, gateway, prefill, decode)

    gateway.requests.labels(code="OK").inc(19)
    gateway.requests.labels(code="UNAVAILABLE").inc(1)
    gateway.pending.set(5)  # 20 finished and 2 more in flight: 22 arrived
    for seconds in [0.3] * 18 + [3.0] * 2:
        gateway.latency.ttft.observe(seconds)
    for _ in range(100):
        gateway.latency.itl.observe(0.03)
    prefill.finish(20, prompt_tokens=1000, output_tokens=1, prefill_s=0.2)
    decode.finish(20, prompt_tokens=1000, output_tokens=100)
    decode.kv.observe_transfer("received", num_blocks=4, num_bytes=1024, seconds=0.05)
    decode.state = EngineSnapshot(8, 2, 0.5, 0, 0, 0, num_awaiting_kv=1)
    obs = observe(first, scrape(110.0, gateway, prefill, decode))

    assert obs.interval_s == 10.0
    assert obs.arrival_rate == pytest.approx(2.2)
    assert obs.mean_prompt_tokens == 1000 and obs.mean_output_tokens == 100
    assert obs.ttft_p90_s == pytest.approx(0.5)  # the 18th of 20 is the top of the (0.25, 0.5] bucket
    assert 0.02 < obs.itl_p90_s <= 0.04
    assert obs.workers == {Role.PREFILL: 1, Role.DECODE: 1}
    assert obs.num_waiting[Role.DECODE] == 2 and obs.num_waiting[Role.PREFILL] == 0
    assert obs.num_awaiting_kv == 1
    assert obs.kv_usage[Role.DECODE] == 0.5
    assert obs.transfer_s == pytest.approx(0.05)
    assert obs.decode_points == obs.prefill_points == ()  # no engine step in the interval


def test_step_points_are_each_workers_mean_step_in_the_interval():
    gateway, prefill, decode = GatewayMetrics(), Worker("p0", Role.PREFILL), Worker("d0", Role.DECODE)
    prefill.step([4000], [4000], 9.0)  # before the interval: not counted
    decode.step([50] * 8, [1] * 8, 9.0)
    first = scrape(100.0, gateway, prefill, decode)
    prefill.step([100, 300], [100, 300], 0.1)  # two whole prompts
    prefill.step([1024], [512], 0.3)  # the last chunk of a 1024-token prompt
    decode.step([100, 200, 300, 400], [1] * 4, 0.02, repeat=2)
    decode.step([100] * 6, [1] * 6, 0.04, repeat=2)
    obs = observe(first, scrape(110.0, gateway, prefill, decode))

    (p,) = obs.prefill_points
    # tokens (400 + 512) / 2; attention (100^2 + 300^2 + 1024^2 - 512^2) / 2; seconds (0.1 + 0.3) / 2
    assert p.features == (1.0, 456.0, 443216.0) and p.seconds == pytest.approx(0.2)
    (d,) = obs.decode_points
    # batch (4 + 4 + 6 + 6) / 4 = 5; context (1000 + 1000 + 600 + 600) / 4 = 800 a step; seconds 0.03
    assert d.features == pytest.approx((1.0, 5.0, 800.0)) and d.seconds == pytest.approx(0.03)


def test_step_points_of_new_restarted_and_idle_workers():
    gateway = GatewayMetrics()
    old, idle = Worker("u0", Role.UNIFIED), Worker("u1", Role.UNIFIED)
    old.step([10] * 3, [1] * 3, 5.0, repeat=10)
    idle.step([10], [10], 5.0)
    first = scrape(0.0, gateway, old, idle)
    restarted, new = Worker("u0", Role.UNIFIED), Worker("u2", Role.UNIFIED)  # u0's counters start over
    restarted.step([20, 30], [1, 1], 0.01)
    new.step([64], [64], 0.05)
    new.step([8, 9], [1, 1], 0.02)  # 17 tokens of context: decode_features takes them per sequence
    obs = observe(first, scrape(5.0, gateway, restarted, idle, new))
    assert sorted(p.features for p in obs.decode_points) == [(1.0, 2.0, 17.0), (1.0, 2.0, 50.0)]
    assert [p.features for p in obs.prefill_points] == [(1.0, 64.0, 4096.0)]  # none from the idle worker


def test_the_refit_on_step_points_recovers_the_step_cost():
    """Steps whose seconds follow a known model, counted by the engine's StepStats, exported by the worker's
    metrics and read back per interval: an OnlineFit without prior points converges to that model."""
    prefill_model, decode_model = LinearModel((0.004, 2e-5, 3e-9)), LinearModel((0.006, 4e-4, 1e-6))
    rng, gateway = random.Random(7), GatewayMetrics()
    workers = [Worker("p0", Role.PREFILL), Worker("d0", Role.DECODE), Worker("d1", Role.DECODE)]
    prefill_fit, decode_fit = OnlineFit(LinearModel((1.0, 1.0, 1.0))), OnlineFit(LinearModel((1.0, 1.0, 1.0)))
    before = scrape(0.0, gateway, *workers)
    for interval in range(1, 11):
        for _ in range(rng.randrange(1, 4)):
            queries = [rng.randrange(16, 2048) for _ in range(rng.randrange(1, 4))]
            seqs = [q + rng.choice([0, 0, 512, 2048]) for q in queries]  # whole prompts and later chunks
            workers[0].step(seqs, queries, prefill_model.predict(prefill_features(queries, seqs)))
        for worker in workers[1:]:
            for _ in range(rng.randrange(1, 6)):
                contexts = [rng.randrange(1, 4096) for _ in range(rng.randrange(1, 64))]
                features = decode_features(len(contexts), sum(contexts) / len(contexts))
                worker.step(contexts, [1] * len(contexts), decode_model.predict(features))
        now = scrape(10.0 * interval, gateway, *workers)
        obs = observe(before, now)
        prefill_fit.add(obs.prefill_points)
        decode_fit.add(obs.decode_points)
        before = now
    assert len(prefill_fit.observed) == 10 and len(decode_fit.observed) == 20
    assert decode_fit.model.coef == pytest.approx(decode_model.coef, rel=1e-6)
    assert prefill_fit.model.coef == pytest.approx(prefill_model.coef, rel=1e-6)


def test_new_restarted_and_departed_workers():
    gateway = GatewayMetrics()
    old, gone = Worker("u0", Role.UNIFIED), Worker("u1", Role.UNIFIED)
    old.finish(50, prompt_tokens=100, output_tokens=100)
    gone.finish(50, prompt_tokens=100, output_tokens=100)
    first = scrape(0.0, gateway, old, gone)
    restarted, new = Worker("u0", Role.UNIFIED), Worker("u2", Role.UNIFIED)  # u0's counters start over
    restarted.finish(4, prompt_tokens=300, output_tokens=30)
    new.finish(4, prompt_tokens=100, output_tokens=10)
    obs = observe(first, scrape(5.0, gateway, restarted, new))
    assert obs.mean_prompt_tokens == 200 and obs.mean_output_tokens == 20
    assert obs.workers == {Role.UNIFIED: 2}
    assert obs.arrival_rate == 0 and obs.ttft_p90_s is None and obs.itl_p90_s is None


def test_a_listed_worker_whose_metrics_did_not_answer_still_counts():
    """Seen on real processes under load: a decode worker's /metrics timed out, the planner counted 0
    decode workers and asked for one more."""
    gateway, prefill, decode = GatewayMetrics(), Worker("p0", Role.PREFILL), Worker("d0", Role.DECODE)
    first = scrape(0.0, gateway, prefill, decode)
    slow = Scrape(5.0, first.gateway, (prefill.scrape(),), num_unread={Role.DECODE: 1})
    assert observe(first, slow).workers == {Role.PREFILL: 1, Role.DECODE: 1}


def test_histogram_quantile():
    assert histogram_quantile(0.9, {0.1: 0, 1.0: 10, math.inf: 10}) == pytest.approx(0.1 + 0.9 * 0.9)
    assert histogram_quantile(0.9, {0.1: 0, 1.0: 5, math.inf: 10}) == 1.0  # beyond the largest bound
    assert histogram_quantile(0.9, {0.1: 0, math.inf: 0}) is None


def test_planner_metrics_export_the_decision():
    observation = Observation(10.0, 10.0, 2.5, 800, 120, None, 0.03, {Role.PREFILL: 1, Role.DECODE: 2})
    decision = Decision(
        Mode.REACTIVE,
        observation,
        (
            TierDecision(Role.PREFILL, 1, 2, Reason.TTFT_OVER),
            TierDecision(Role.DECODE, 2, 2, Reason.WITHIN_TARGET),
        ),
    )
    metrics = PlannerMetrics()
    metrics.record(decision, "sent")
    samples = Samples.parse(generate_latest(metrics.registry).decode()).values
    assert samples["splitserve_planner_desired_workers", frozenset({("tier", "prefill")})] == 2
    assert samples["splitserve_planner_desired_workers", frozenset({("tier", "decode")})] == 2
    assert samples["splitserve_planner_current_workers", frozenset({("tier", "prefill")})] == 1
    up = frozenset({("tier", "prefill"), ("action", "up"), ("reason", "ttft_over")})
    assert samples["splitserve_planner_decisions_total", up] == 1
    assert samples["splitserve_planner_scale_calls_total", frozenset({("result", "sent")})] == 1
    assert samples["splitserve_planner_arrival_rate", frozenset()] == 2.5
    assert math.isnan(samples["splitserve_planner_ttft_p90_seconds", frozenset()])
