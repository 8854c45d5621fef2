"""The reader on /metrics texts rendered by the gateway's and the workers' own metric classes (no
processes), and the planner's own series."""

from __future__ import annotations

import math

import pytest
from prometheus_client import generate_latest

from splitserve.common.roles import Role
from splitserve.gateway.metrics import GatewayMetrics
from splitserve.planner.metrics import PlannerMetrics
from splitserve.planner.policy import Decision, Mode, Observation, Reason, TierDecision
from splitserve.planner.reader import Samples, Scrape, WorkerScrape, histogram_quantile, observe
from splitserve.worker.metrics import EngineSnapshot, RequestTiming, WorkerMetrics

pytestmark = pytest.mark.unit


class Worker:
    """A worker's metrics with an engine state the test sets."""

    def __init__(self, address: str, role: Role) -> None:
        self.address, self.role = address, role
        self.state = EngineSnapshot(0, 0, 0.0, 0, 0, 0)
        self.metrics = WorkerMetrics("tiny", role.value, lambda: self.state)

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
    for _ in range(50):
        decode.metrics.observe_token_gap(0.025)
    decode.metrics.observe_transfer("received", num_blocks=4, num_bytes=1024, seconds=0.05)
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
    (decode_point,) = obs.decode_points
    assert decode_point.features == (1.0, 4.0, 4.0 * 1050) and decode_point.seconds == pytest.approx(0.025)
    (prefill_point,) = obs.prefill_points
    assert prefill_point.features[1] == 1000 and prefill_point.seconds == pytest.approx(0.2)


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
