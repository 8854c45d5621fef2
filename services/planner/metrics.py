"""The planner's own Prometheus series, in a registry of its own (served on `planner --metrics-port`).

splitserve_planner_desired_workers{tier} is the decision itself: with `--dry-run` the planner only
publishes it, and a Kubernetes autoscaler (KEDA's Prometheus scaler, or an HPA through
prometheus-adapter) sizes each tier's Deployment from it. The tier label is Role's value. It appears
with the first decision, not before (a 0 there would read as "no workers").
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from splitserve.services.planner.policy import Decision

SCALE_RESULTS = ("sent", "unchanged", "in_flight", "dry_run", "failed")  # the `result` label of scale calls


class PlannerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.desired = Gauge(
            "splitserve_planner_desired_workers", "Workers per tier the planner decided on.", ["tier"], registry=r
        )
        self.current = Gauge(
            "splitserve_planner_current_workers", "Live workers per tier at the last decision.", ["tier"], registry=r
        )
        self.decisions = Counter(
            "splitserve_planner_decisions",
            "Decisions per tier, by action (up, down, hold) and reason.",
            ["tier", "action", "reason"],
            registry=r,
        )
        self.scale_calls = Counter(
            "splitserve_planner_scale_calls", "Decisions sent to the launcher, by result.", ["result"], registry=r
        )
        for result in SCALE_RESULTS:
            self.scale_calls.labels(result=result)
        self.arrival_rate = Gauge("splitserve_planner_arrival_rate", "Requests/s arriving, last interval.", registry=r)
        self.prompt_tokens = Gauge("splitserve_planner_mean_prompt_tokens", "Last interval's mean.", registry=r)
        self.output_tokens = Gauge("splitserve_planner_mean_output_tokens", "Last interval's mean.", registry=r)
        self.ttft = Gauge("splitserve_planner_ttft_p90_seconds", "Last interval's TTFT p90 (NaN: none).", registry=r)
        self.itl = Gauge("splitserve_planner_itl_p90_seconds", "Last interval's ITL p90 (NaN: none).", registry=r)

    def record(self, decision: Decision, scale_result: str) -> None:
        for d in decision.tiers:
            self.desired.labels(tier=d.tier.value).set(d.desired)
            self.current.labels(tier=d.tier.value).set(d.current)
            self.decisions.labels(tier=d.tier.value, action=d.action, reason=d.reason.value).inc()
        self.scale_calls.labels(result=scale_result).inc()
        obs = decision.observation
        self.arrival_rate.set(obs.arrival_rate)
        self.prompt_tokens.set(obs.mean_prompt_tokens)
        self.output_tokens.set(obs.mean_output_tokens)
        self.ttft.set(float("nan") if obs.ttft_p90_s is None else obs.ttft_p90_s)
        self.itl.set(float("nan") if obs.itl_p90_s is None else obs.itl_p90_s)
