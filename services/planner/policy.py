"""The planner's decisions: each interval, an Observation in, a Decision (workers per tier, and why) out.

Two policies, one contract (Policy.decide):
- predictive: forecast the load a start-up time ahead (Holt), size each tier for it from the
  performance profile (capacity.py), refitting the profile on the steps the workers are seen to take;
  up at once; down only when fewer workers would serve the load plus `down_margin` too, after
  `down_intervals` intervals in a row that want fewer and `cooldown_s` after the tier's last change
  (to the most any of those intervals wanted).
- reactive: +1 on the tier at fault after `up_intervals` intervals over a target (TTFT p90: the prefill
  tier, or the decode tier when prompts wait there; ITL p90 or a full KV cache: the decode tier), -1
  after `down_intervals` intervals well under (p90 below low_watermark * target, nothing queued);
  no +1 within `up_cooldown_s` of the tier's last change (its new worker starting), no -1 within
  `cooldown_s`. At the budget, a tier at fault takes a worker from a tier that is under its targets.
Both are held within each tier's [min, max] and the total budget. The tiers are prefill and decode
(disaggregated) or unified (colocated), named by Role, whose values are also the metric labels.
"""

from __future__ import annotations

import enum
import math
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, replace

from splitserve.common.roles import Role
from splitserve.services.planner.capacity import Sizing, SloTargets, TierNeed, decode_need, prefill_need, unified_need
from splitserve.services.planner.forecast import Load, LoadForecaster
from splitserve.services.planner.profile import Point, Profile, RefinedProfile

DISAGGREGATED = (Role.PREFILL, Role.DECODE)
COLOCATED = (Role.UNIFIED,)


class Mode(enum.Enum):
    PREDICTIVE = "predictive"
    REACTIVE = "reactive"


class Reason(enum.Enum):
    """Why a tier has the count a decision gives it (the `reason` label of the decisions counter)."""

    FORECAST = "forecast"  # predictive: the forecast load needs this many
    INFEASIBLE = "infeasible"  # predictive: no count meets the target; sized for utilisation
    SCALE_UP_PENDING = "scale_up_pending"  # reactive: over a target, not yet for long enough
    SCALE_DOWN_PENDING = "scale_down_pending"  # wants fewer (under target), not yet for long enough
    TTFT_OVER = "ttft_over"
    ITL_OVER = "itl_over"
    KV_FULL = "kv_full"
    UNDER_TARGET = "under_target"  # reactive: well under the targets for long enough
    WITHIN_TARGET = "within_target"  # reactive: nothing to do
    COOLDOWN = "cooldown"  # a change wanted too soon after the tier's last one
    REBALANCE = "rebalance"  # gave a worker to a tier at fault, at the budget
    MIN_WORKERS = "min_workers"
    MAX_WORKERS = "max_workers"
    BUDGET = "budget"


@dataclass(frozen=True, slots=True)
class Observation:
    """One interval of the cluster as the planner sees it (reader.py: from /metrics; simulator.py)."""

    time_s: float  # end of the interval, monotonic
    interval_s: float
    arrival_rate: float  # requests/s that arrived at the gateway
    mean_prompt_tokens: float  # of the requests finished in the interval (0: none finished)
    mean_output_tokens: float
    ttft_p90_s: float | None  # None: no first token in the interval
    itl_p90_s: float | None
    workers: Mapping[Role, int]  # live workers per tier (draining ones left out)
    num_waiting: Mapping[Role, int] = field(default_factory=dict)  # requests queued in each tier
    num_awaiting_kv: int = 0  # decode tier: requests whose KV is in flight
    kv_usage: Mapping[Role, float] = field(default_factory=dict)  # each tier's fullest worker, 0..1
    transfer_s: float | None = None  # mean KV transfer time; None: none seen
    prefill_points: tuple[Point, ...] = ()  # steps observed, for the online refit of the profile
    decode_points: tuple[Point, ...] = ()

    def to_json(self) -> dict:
        data = asdict(self)
        for key in ("workers", "num_waiting", "kv_usage"):
            data[key] = {role.value: value for role, value in data[key].items()}
        data["num_prefill_points"], data["num_decode_points"] = len(self.prefill_points), len(self.decode_points)
        del data["prefill_points"], data["decode_points"]
        return data


@dataclass(frozen=True, slots=True)
class TierBounds:
    min_workers: int = 1  # >= 1: a tier at zero would fail the requests that reach it
    max_workers: int = 8

    def __post_init__(self) -> None:
        if not 1 <= self.min_workers <= self.max_workers:
            raise ValueError(f"need 1 <= min_workers <= max_workers, got {self}")


@dataclass(frozen=True, slots=True)
class Bounds:
    tiers: Mapping[Role, TierBounds]  # DISAGGREGATED or COLOCATED
    budget: int  # workers over all tiers

    def __post_init__(self) -> None:
        if tuple(self.tiers) not in (DISAGGREGATED, COLOCATED):
            raise ValueError(f"plan prefill and decode tiers, or a unified one; got {[r.value for r in self.tiers]}")
        if sum(b.min_workers for b in self.tiers.values()) > self.budget:
            raise ValueError(f"the tiers' minimums exceed the budget of {self.budget} workers")

    def fit(self, wanted: dict[Role, int], reasons: dict[Role, Reason]) -> None:
        """Clamp each tier to [min, max], then share the budget in proportion to what each tier wants
        above its minimum (largest remainder). Changes wanted and reasons in place."""
        for tier, b in self.tiers.items():
            if wanted[tier] < b.min_workers:
                wanted[tier], reasons[tier] = b.min_workers, Reason.MIN_WORKERS
            elif wanted[tier] > b.max_workers:
                wanted[tier], reasons[tier] = b.max_workers, Reason.MAX_WORKERS
        if sum(wanted.values()) <= self.budget:
            return
        extra = {t: wanted[t] - b.min_workers for t, b in self.tiers.items()}
        room, total = self.budget - sum(b.min_workers for b in self.tiers.values()), sum(extra.values())
        shares = {t: room * e / total for t, e in extra.items()}
        given = {t: math.floor(s) for t, s in shares.items()}
        for t in sorted(shares, key=lambda t: shares[t] - given[t], reverse=True)[: room - sum(given.values())]:
            given[t] += 1
        for tier, b in self.tiers.items():
            if b.min_workers + given[tier] < wanted[tier]:
                wanted[tier], reasons[tier] = b.min_workers + given[tier], Reason.BUDGET


@dataclass(frozen=True, slots=True)
class PlannerConfig:
    targets: SloTargets
    bounds: Bounds
    mode: Mode = Mode.REACTIVE
    sizing: Sizing = Sizing()
    lead_s: float = 30.0  # predictive: plan for the load this far ahead (about a new worker's start-up)
    down_margin: float = 0.2  # predictive: fewer workers only if they would serve this much more load too
    smoothing: float = 0.3  # predictive: Holt's alpha, the newest interval's weight in the level
    trend_smoothing: float = 0.2  # predictive: Holt's beta, the newest change's weight in the trend
    up_intervals: int = 2  # reactive: intervals over a target before +1
    down_intervals: int = 6  # intervals under target (reactive) or wanting fewer (predictive) before fewer
    low_watermark: float = 0.5  # reactive: "well under" is a p90 below this fraction of its target
    kv_high: float = 0.9  # reactive: a decode (or unified) tier this full counts as over
    cooldown_s: float = 60.0  # no scale-down of a tier this soon after its last change
    up_cooldown_s: float = 20.0  # reactive: no second +1 before the first worker had time to start and help

    def __post_init__(self) -> None:
        if self.up_intervals < 1 or self.down_intervals < 1:
            raise ValueError(f"need up_intervals and down_intervals >= 1: {self}")
        if min(self.lead_s, self.down_margin, self.cooldown_s, self.up_cooldown_s) < 0:
            raise ValueError(f"need lead_s, down_margin and the cooldowns >= 0: {self}")
        if not (0 < self.low_watermark < 1 and 0 < self.kv_high <= 1):
            raise ValueError(f"low_watermark in (0, 1) and kv_high in (0, 1] please: {self}")

    @property
    def tiers(self) -> tuple[Role, ...]:
        return tuple(self.bounds.tiers)


@dataclass(frozen=True, slots=True)
class TierDecision:
    tier: Role
    current: int
    desired: int
    reason: Reason

    @property
    def action(self) -> str:
        return "up" if self.desired > self.current else "down" if self.desired < self.current else "hold"


@dataclass(frozen=True, slots=True)
class Decision:
    mode: Mode
    observation: Observation
    tiers: tuple[TierDecision, ...]
    inputs: Mapping[str, float] = field(default_factory=dict)  # forecast and model values behind it

    def desired(self) -> dict[Role, int]:
        return {d.tier: d.desired for d in self.tiers}

    @property
    def changed(self) -> bool:
        return any(d.desired != d.current for d in self.tiers)

    def to_json(self) -> dict:
        return {
            "time_s": round(self.observation.time_s, 3),
            "mode": self.mode.value,
            "tiers": {
                d.tier.value: {"current": d.current, "desired": d.desired, "action": d.action, "reason": d.reason.value}
                for d in self.tiers
            },
            "inputs": {k: _rounded(v) for k, v in self.inputs.items()},
            "observation": {k: _rounded(v) for k, v in self.observation.to_json().items()},
        }


def _rounded(value):
    return round(value, 6) if isinstance(value, float) and math.isfinite(value) else value


class Policy(ABC):
    """Decides the workers per tier from one interval's observation. Called once per interval, in time
    order; keeps what it needs between calls (streaks, forecasts, the last change of each tier)."""

    def __init__(self, config: PlannerConfig) -> None:
        self.config = config
        self._changed_at = dict.fromkeys(config.tiers, -math.inf)  # the time_s each tier's size last changed

    @abstractmethod
    def decide(self, obs: Observation) -> Decision: ...

    def _decision(
        self, obs: Observation, wanted: dict[Role, int], reasons: dict[Role, Reason], inputs: Mapping[str, float]
    ) -> Decision:
        self.config.bounds.fit(wanted, reasons)
        tiers = tuple(TierDecision(t, obs.workers.get(t, 0), wanted[t], reasons[t]) for t in self.config.tiers)
        for d in tiers:
            if d.desired != d.current:
                self._changed_at[d.tier] = obs.time_s
                self._changed(d.tier)
        return Decision(self.config.mode, obs, tiers, inputs)

    def _changed(self, tier: Role) -> None:
        """This decision changes tier's size: forget what led up to it (streaks, pending steps down)."""


def _ttft_p90(obs: Observation) -> float | None:
    """The interval's TTFT p90; with no first token in it while prompts wait, the interval's length (the
    oldest of them has waited that long: a lower bound, so a stalled prefill tier is seen as over)."""
    if obs.ttft_p90_s is None and obs.arrival_rate > 0 and sum(obs.num_waiting.values()) > 0:
        return obs.interval_s
    return obs.ttft_p90_s


class ReactivePolicy(Policy):
    """+1 / -1 on measured p90s, with streaks (hysteresis) and a cooldown (module docstring)."""

    def __init__(self, config: PlannerConfig, profile: Profile | None = None) -> None:
        super().__init__(config)
        self._over = dict.fromkeys(config.tiers, 0)  # intervals in a row over a target
        self._under = dict.fromkeys(config.tiers, 0)  # intervals in a row well under

    def decide(self, obs: Observation) -> Decision:
        faults, unders = self._faults(obs), self._unders(obs)
        wanted: dict[Role, int] = {}
        reasons: dict[Role, Reason] = {}
        for tier in self.config.tiers:
            self._over[tier] = self._over[tier] + 1 if faults[tier] else 0
            self._under[tier] = self._under[tier] + 1 if unders[tier] else 0
            step, reason = self._step(tier, faults[tier], obs.workers.get(tier, 0))
            if step and self._cooling(tier, obs.time_s, up=step > 0):
                step, reason = 0, Reason.COOLDOWN
            wanted[tier], reasons[tier] = obs.workers.get(tier, 0) + step, reason
        self._rebalance(obs, wanted, reasons)
        t = self.config.targets
        return self._decision(obs, wanted, reasons, {"ttft_target_s": t.ttft_s, "itl_target_s": t.itl_s})

    def _changed(self, tier: Role) -> None:
        self._over[tier], self._under[tier] = 0, 0

    def _step(self, tier: Role, fault: Reason | None, current: int) -> tuple[int, Reason]:
        if fault is not None:
            return (1, fault) if self._over[tier] >= self.config.up_intervals else (0, Reason.SCALE_UP_PENDING)
        if self._under[tier] >= self.config.down_intervals:
            return -1, Reason.UNDER_TARGET
        if self._under[tier] and current > self.config.bounds.tiers[tier].min_workers:
            return 0, Reason.SCALE_DOWN_PENDING
        return 0, Reason.WITHIN_TARGET

    def _cooling(self, tier: Role, now: float, up: bool) -> bool:
        return now - self._changed_at[tier] < (self.config.up_cooldown_s if up else self.config.cooldown_s)

    def _faults(self, obs: Observation) -> dict[Role, Reason | None]:
        """The tier at fault for each target that is over (TTFT: prefill, unless prompts wait at decode)."""
        t = self.config.targets
        ttft = _ttft_p90(obs)
        ttft_over = ttft is not None and ttft > t.ttft_s
        itl_over = obs.itl_p90_s is not None and obs.itl_p90_s > t.itl_s

        def first(*found: tuple[bool, Reason]) -> Reason | None:
            return next((reason for hit, reason in found if hit), None)

        if self.config.tiers == COLOCATED:
            kv_full = obs.kv_usage.get(Role.UNIFIED, 0.0) >= self.config.kv_high
            found = first((ttft_over, Reason.TTFT_OVER), (itl_over, Reason.ITL_OVER), (kv_full, Reason.KV_FULL))
            return {Role.UNIFIED: found}
        at_decode = obs.num_waiting.get(Role.PREFILL, 0) == 0 and obs.num_waiting.get(Role.DECODE, 0) > 0
        kv_full = obs.kv_usage.get(Role.DECODE, 0.0) >= self.config.kv_high
        decode = first(
            (itl_over, Reason.ITL_OVER), (kv_full, Reason.KV_FULL), (ttft_over and at_decode, Reason.TTFT_OVER)
        )
        return {Role.PREFILL: first((ttft_over and not at_decode, Reason.TTFT_OVER)), Role.DECODE: decode}

    def _unders(self, obs: Observation) -> dict[Role, bool]:
        """Well under target with nothing queued. An interval without a p90 counts as under only when no
        request arrived in it: under load it means no request got that far (e.g. all queued)."""
        t, low, idle = self.config.targets, self.config.low_watermark, obs.arrival_rate == 0
        ttft_low = idle if obs.ttft_p90_s is None else obs.ttft_p90_s < low * t.ttft_s
        itl_low = idle if obs.itl_p90_s is None else obs.itl_p90_s < low * t.itl_s

        def quiet(tier: Role) -> bool:
            return obs.num_waiting.get(tier, 0) == 0 and obs.kv_usage.get(tier, 0.0) < low * self.config.kv_high

        if self.config.tiers == COLOCATED:
            return {Role.UNIFIED: ttft_low and itl_low and quiet(Role.UNIFIED)}
        return {Role.PREFILL: ttft_low and quiet(Role.PREFILL), Role.DECODE: itl_low and quiet(Role.DECODE)}

    def _rebalance(self, obs: Observation, wanted: dict[Role, int], reasons: dict[Role, Reason]) -> None:
        """At the budget, a growing tier (below its max) takes a worker from a tier under its targets (and
        not cooling). A tier at its max cannot grow, so it takes nothing: the other would only shrink."""
        bounds = self.config.bounds
        growing = (t for t in self.config.tiers if obs.workers.get(t, 0) < wanted[t] <= bounds.tiers[t].max_workers)
        for tier in growing:
            if sum(wanted.values()) <= bounds.budget:
                return
            for other in (o for o in self.config.tiers if o != tier and self._under[o] > 0):
                current = obs.workers.get(other, 0)
                if wanted[other] == current > bounds.tiers[other].min_workers and not self._cooling(
                    other, obs.time_s, up=False
                ):
                    wanted[other], reasons[other] = current - 1, Reason.REBALANCE
                    break


class PredictivePolicy(Policy):
    """Forecast, size from the (refitted) profile, damp the way down (module docstring)."""

    def __init__(self, config: PlannerConfig, profile: Profile | None = None) -> None:
        super().__init__(config)
        if profile is None:
            raise ValueError("the predictive planner needs a performance profile: --profile FILE (splitserve profile)")
        self.profile = RefinedProfile(profile)
        self.forecaster = LoadForecaster(config.smoothing, config.trend_smoothing)
        self._fewer = {t: deque[int](maxlen=config.down_intervals) for t in config.tiers}

    def decide(self, obs: Observation) -> Decision:
        self.profile.add(obs.prefill_points, obs.decode_points)
        profile = self.profile.current()
        load = self._forecast(obs)
        needs = self._needs(obs, load, profile)
        # The way down is sized for a little more load: a dead band, so noise at a boundary moves nothing
        margin = self._needs(obs, replace(load, rate=load.rate * (1 + self.config.down_margin)), profile)
        wanted: dict[Role, int] = {}
        reasons: dict[Role, Reason] = {}
        for tier, need in needs.items():
            wanted[tier], reasons[tier] = self._damped(tier, obs, need, margin[tier].workers)
        inputs = {"forecast_rate": load.rate, "forecast_prompt_tokens": load.prompt_tokens}
        inputs["forecast_output_tokens"] = load.output_tokens
        inputs |= {f"{tier.value}_{k}": v for tier, need in needs.items() for k, v in need.inputs.items()}
        inputs |= {f"{tier.value}_needed": float(need.workers) for tier, need in needs.items()}
        return self._decision(obs, wanted, reasons, inputs)

    def _changed(self, tier: Role) -> None:
        self._fewer[tier].clear()

    def _forecast(self, obs: Observation) -> Load:
        """The load a lead time ahead, its rate never below the smoothed rate now (a fall must be seen first)."""
        self.forecaster.update(Load(obs.arrival_rate, obs.mean_prompt_tokens, obs.mean_output_tokens))
        ahead = self.forecaster.forecast(self.config.lead_s / obs.interval_s)
        return Load(max(ahead.rate, self.forecaster.rate.forecast(0)), ahead.prompt_tokens, ahead.output_tokens)

    def _needs(self, obs: Observation, load: Load, profile: Profile) -> dict[Role, TierNeed]:
        """Each tier sized for the load plus its queue, drained within a lead time."""
        c = self.config

        def with_backlog(tier: Role) -> Load:
            drain_s = max(c.lead_s, obs.interval_s)
            return replace(load, rate=load.rate + obs.num_waiting.get(tier, 0) / drain_s)

        if c.tiers == COLOCATED:
            return {Role.UNIFIED: unified_need(with_backlog(Role.UNIFIED), profile, c.targets, c.sizing)}
        transfer_s = obs.transfer_s or 0.0
        return {
            Role.PREFILL: prefill_need(with_backlog(Role.PREFILL), profile, c.targets, c.sizing, transfer_s),
            Role.DECODE: decode_need(with_backlog(Role.DECODE), profile, c.targets, c.sizing),
        }

    def _damped(self, tier: Role, obs: Observation, need: TierNeed, with_margin: int) -> tuple[int, Reason]:
        b, current = self.config.bounds.tiers[tier], obs.workers.get(tier, 0)
        workers, down_to = (min(max(n, b.min_workers), b.max_workers) for n in (need.workers, with_margin))
        reason = Reason.FORECAST if need.feasible else Reason.INFEASIBLE
        fewer = self._fewer[tier]
        if workers >= current or down_to >= current:
            fewer.clear()
            return max(workers, current), reason
        fewer.append(down_to)
        if len(fewer) < self.config.down_intervals:
            return current, Reason.SCALE_DOWN_PENDING
        if obs.time_s - self._changed_at[tier] < self.config.cooldown_s:
            return current, Reason.COOLDOWN
        return max(fewer), reason


_POLICIES: dict[Mode, Callable[[PlannerConfig, Profile | None], Policy]] = {
    Mode.PREDICTIVE: PredictivePolicy,
    Mode.REACTIVE: ReactivePolicy,
}


def make_policy(config: PlannerConfig, profile: Profile | None = None) -> Policy:
    """The policy of config.mode (predictive: ValueError without a profile)."""
    return _POLICIES[config.mode](config, profile)
