"""The planner's decisions as pure functions of observations: forecasts, sizing, bounds, both policies."""

from __future__ import annotations

import json
import math

import pytest

from splitserve.common.roles import Role
from splitserve.services.planner.capacity import (
    Sizing,
    SloTargets,
    decode_batch,
    decode_need,
    prefill_need,
    unified_need,
    wait_p90_s,
)
from splitserve.services.planner.forecast import Holt, Load, LoadForecaster
from splitserve.services.planner.policy import (
    Bounds,
    Mode,
    Observation,
    PlannerConfig,
    Reason,
    TierBounds,
    make_policy,
)
from splitserve.services.planner.profile import LinearModel, Profile, WorkerLimits

PROFILE = Profile(LinearModel((0.01, 1e-4, 1e-8)), LinearModel((0.02, 5e-4, 2e-7)), WorkerLimits(4096, 64, 400_000))
TARGETS = SloTargets(ttft_s=1.0, itl_s=0.06)
SIZING = Sizing()
DISAGG = Bounds({Role.PREFILL: TierBounds(1, 8), Role.DECODE: TierBounds(1, 6)}, budget=10)


def obs(t: float, ttft: float | None = 0.2, itl: float | None = 0.02, prefill: int = 2, decode: int = 2, **kw):
    defaults = dict(arrival_rate=2.0, mean_prompt_tokens=500.0, mean_output_tokens=100.0)
    return Observation(
        time_s=t,
        interval_s=5.0,
        ttft_p90_s=ttft,
        itl_p90_s=itl,
        workers={Role.PREFILL: prefill, Role.DECODE: decode},
        **(defaults | kw),
    )


def reactive(**kw):
    config = PlannerConfig(TARGETS, kw.pop("bounds", DISAGG), Mode.REACTIVE, **kw)
    return make_policy(config)


# -- forecasts and sizing --------------------------------------------------------------------------
def test_holt_follows_a_linear_trend():
    holt = Holt(alpha=0.5, beta=0.5)
    for v in range(10):
        holt.update(2.0 * v)
    assert holt.forecast(3) == pytest.approx(2.0 * 12, rel=0.05)
    assert Holt().forecast(1) == 0.0


def test_forecaster_keeps_lengths_through_idle_intervals():
    f = LoadForecaster()
    f.update(Load(2.0, 800, 50))
    f.update(Load(0.0, 0, 0))
    assert f.forecast(0).prompt_tokens == 800


def test_md1_wait():
    assert wait_p90_s(0.05, 1.0) == 0.0  # rho 0.05: the p90 request does not wait
    assert wait_p90_s(1.0, 1.0) == math.inf
    # rho 0.8, service 1 s: mean wait 2 s, p90 = 2 / 0.8 * ln 8
    assert wait_p90_s(0.8, 1.0) == pytest.approx(2 / 0.8 * math.log(8))


def test_prefill_tier_grows_with_rate_and_meets_its_ttft_budget():
    light, heavy = Load(1.0, 3000, 100), Load(8.0, 3000, 100)
    assert prefill_need(light, PROFILE, TARGETS, SIZING).workers < prefill_need(heavy, PROFILE, TARGETS, SIZING).workers
    need = prefill_need(heavy, PROFILE, TARGETS, SIZING)
    assert need.feasible and need.inputs["predicted_ttft_p90_s"] <= need.inputs["ttft_budget_s"]
    assert heavy.rate / need.workers <= SIZING.utilisation * PROFILE.prefill_rate(3000)


def test_a_ttft_target_below_a_lone_prompt_is_infeasible():
    need = prefill_need(Load(1.0, 30_000, 10), PROFILE, SloTargets(0.5, 0.06), SIZING)
    assert not need.feasible and need.workers >= 1


def test_decode_batch_is_the_largest_within_the_itl_target():
    load = Load(4.0, 1000, 200)
    batch, feasible = decode_batch(PROFILE, load, 0.054)
    assert feasible
    context = 1000 + 100
    assert PROFILE.decode_step_s(batch, context) <= 0.054 < PROFILE.decode_step_s(batch + 1, context)
    kv_bound = Profile(PROFILE.prefill, PROFILE.decode, WorkerLimits(4096, 64, 12_000))
    assert decode_batch(kv_bound, load, 0.054)[0] == 12_000 // 1200


def test_decode_tier_serves_the_token_rate():
    load = Load(10.0, 1000, 200)
    need = decode_need(load, PROFILE, TARGETS, SIZING)
    per_worker = need.inputs["tokens_per_s_per_worker"]
    assert (need.workers - 1) * per_worker * SIZING.utilisation < load.rate * 200 <= need.workers * per_worker
    assert decode_need(Load(0.0, 0, 0), PROFILE, TARGETS, SIZING).workers == 0


def test_a_unified_worker_does_both_jobs():
    load = Load(6.0, 1500, 150)
    unified = unified_need(load, PROFILE, TARGETS, SIZING).workers
    assert unified >= prefill_need(load, PROFILE, TARGETS, SIZING).workers
    assert unified >= decode_need(load, PROFILE, TARGETS, SIZING).workers


# -- bounds ----------------------------------------------------------------------------------------
def test_bounds_clamp_each_tier_then_share_the_budget():
    wanted = {Role.PREFILL: 12, Role.DECODE: 0}
    reasons = {Role.PREFILL: Reason.FORECAST, Role.DECODE: Reason.FORECAST}
    DISAGG.fit(wanted, reasons)
    assert wanted == {Role.PREFILL: 8, Role.DECODE: 1}
    assert reasons == {Role.PREFILL: Reason.MAX_WORKERS, Role.DECODE: Reason.MIN_WORKERS}
    wanted = {Role.PREFILL: 8, Role.DECODE: 6}  # 14 > 10: 8 extra over the minimums, shared 7:5
    DISAGG.fit(wanted, reasons)
    assert wanted == {Role.PREFILL: 6, Role.DECODE: 4} and sum(wanted.values()) == 10
    assert reasons[Role.PREFILL] is reasons[Role.DECODE] is Reason.BUDGET


def test_bounds_refuse_what_cannot_work():
    with pytest.raises(ValueError, match="budget"):
        Bounds({Role.PREFILL: TierBounds(3, 4), Role.DECODE: TierBounds(3, 4)}, budget=5)
    with pytest.raises(ValueError, match="prefill and decode"):
        Bounds({Role.PREFILL: TierBounds()}, budget=5)
    with pytest.raises(ValueError, match="min_workers"):
        TierBounds(0, 4)


# -- reactive --------------------------------------------------------------------------------------
def test_reactive_adds_a_prefill_worker_after_k_intervals_over_ttft():
    policy = reactive(up_intervals=2)
    first = policy.decide(obs(5, ttft=3.0))
    assert first.desired() == {Role.PREFILL: 2, Role.DECODE: 2} and first.tiers[0].reason is Reason.SCALE_UP_PENDING
    second = policy.decide(obs(10, ttft=3.0))
    assert second.desired() == {Role.PREFILL: 3, Role.DECODE: 2}
    assert second.tiers[0].action == "up" and second.tiers[0].reason is Reason.TTFT_OVER


def test_reactive_blames_decode_for_ttft_when_prompts_wait_there():
    policy = reactive(up_intervals=1)
    d = policy.decide(obs(5, ttft=3.0, num_waiting={Role.PREFILL: 0, Role.DECODE: 7}))
    assert d.desired() == {Role.PREFILL: 2, Role.DECODE: 3}
    assert d.tiers[1].reason is Reason.TTFT_OVER


def test_reactive_itl_and_kv_go_to_decode():
    policy = reactive(up_intervals=1)
    assert policy.decide(obs(5, itl=0.2)).desired() == {Role.PREFILL: 2, Role.DECODE: 3}
    policy = reactive(up_intervals=1)
    d = policy.decide(obs(5, kv_usage={Role.DECODE: 0.95}))
    assert d.desired()[Role.DECODE] == 3 and d.tiers[1].reason is Reason.KV_FULL


def test_reactive_cools_down_and_scales_down_only_after_m_quiet_intervals():
    policy = reactive(up_intervals=1, down_intervals=3, cooldown_s=30, up_cooldown_s=15)
    assert policy.decide(obs(5, ttft=3.0)).desired()[Role.PREFILL] == 3
    held = policy.decide(obs(10, ttft=3.0, prefill=3))
    assert held.desired()[Role.PREFILL] == 3 and held.tiers[0].reason is Reason.COOLDOWN
    assert policy.decide(obs(20, ttft=3.0, prefill=3)).desired()[Role.PREFILL] == 4  # 15 s on
    quiet = [policy.decide(obs(t, ttft=0.1, prefill=4)).desired()[Role.PREFILL] for t in range(25, 80, 5)]
    # 3 quiet intervals (t=35), and 30 s after the change at t=20: t=50 is the first -1
    assert quiet[:5] == [4] * 5 and quiet[5] == 3


def test_reactive_holds_with_a_p90_between_the_watermark_and_the_target():
    policy = reactive(up_intervals=1, down_intervals=1, cooldown_s=0)
    for t in range(5, 50, 5):
        d = policy.decide(obs(t, ttft=0.7, itl=0.04))
        assert not d.changed and {x.reason for x in d.tiers} == {Reason.WITHIN_TARGET}


def test_reactive_at_the_budget_takes_a_worker_from_a_quiet_tier():
    bounds = Bounds({Role.PREFILL: TierBounds(1, 8), Role.DECODE: TierBounds(1, 8)}, budget=6)
    policy = reactive(bounds=bounds, up_intervals=2, cooldown_s=0)
    policy.decide(obs(5, ttft=3.0, itl=0.005, prefill=3, decode=3))
    d = policy.decide(obs(10, ttft=3.0, itl=0.005, prefill=3, decode=3))
    assert d.desired() == {Role.PREFILL: 4, Role.DECODE: 2}
    assert [x.reason for x in d.tiers] == [Reason.TTFT_OVER, Reason.REBALANCE]


def test_reactive_a_tier_at_its_max_takes_no_worker_from_another():
    """Seen on real processes: decode (max 1) with a full KV cache took the second prefill worker away
    mid-burst, and the bounds then held decode at 1, so the system only shrank."""
    bounds = Bounds({Role.PREFILL: TierBounds(1, 2), Role.DECODE: TierBounds(1, 1)}, budget=3)
    policy = reactive(bounds=bounds, up_intervals=1, cooldown_s=0)
    d = policy.decide(obs(5, ttft=0.1, prefill=2, decode=1, kv_usage={Role.DECODE: 0.99}))
    assert d.desired() == {Role.PREFILL: 2, Role.DECODE: 1}, d.to_json()["tiers"]


def test_reactive_an_interval_without_first_tokens_under_load_is_not_quiet():
    """No TTFT sample in an interval while requests arrive means none finished prefill: not "well under"."""
    policy = reactive(up_intervals=1, down_intervals=1, cooldown_s=0)
    d = policy.decide(obs(5, ttft=None, itl=None, arrival_rate=3.0))
    assert not d.changed, d.to_json()["tiers"]
    idle = policy.decide(obs(10, ttft=None, itl=None, arrival_rate=0.0))
    assert idle.desired() == {Role.PREFILL: 1, Role.DECODE: 1}


def test_reactive_an_interval_without_first_tokens_while_prompts_wait_is_over_ttft():
    """A prefill tier so slow that no prompt got its first token in an interval: every waiting prompt
    has waited about that long, which bounds the TTFT p90 from below."""
    policy = reactive(up_intervals=2)
    waiting = {Role.PREFILL: 6, Role.DECODE: 0}
    for t in (5, 10):  # interval_s = 5 > the 1 s TTFT target
        d = policy.decide(obs(t, ttft=None, itl=None, arrival_rate=1.0, num_waiting=waiting))
    assert d.desired() == {Role.PREFILL: 3, Role.DECODE: 2} and d.tiers[0].reason is Reason.TTFT_OVER


def test_reactive_colocated_tier():
    bounds = Bounds({Role.UNIFIED: TierBounds(1, 4)}, budget=4)
    policy = reactive(bounds=bounds, up_intervals=1)
    o = Observation(5, 5, 3.0, 500, 100, 2.5, 0.02, {Role.UNIFIED: 2})
    d = policy.decide(o)
    assert d.desired() == {Role.UNIFIED: 3} and d.tiers[0].reason is Reason.TTFT_OVER


# -- predictive ------------------------------------------------------------------------------------
def predictive(**kw):
    return make_policy(PlannerConfig(TARGETS, DISAGG, Mode.PREDICTIVE, **kw), PROFILE)


def test_predictive_sizes_for_the_forecast_at_once():
    policy = predictive()
    d = policy.decide(obs(5, arrival_rate=6.0, mean_prompt_tokens=3000, mean_output_tokens=100))
    load = Load(6.0, 3000, 100)
    assert d.desired()[Role.PREFILL] == prefill_need(load, PROFILE, TARGETS, SIZING, 0.0).workers > 2
    assert d.tiers[0].reason is Reason.FORECAST
    assert d.inputs["forecast_rate"] == 6.0 and "prefill_predicted_ttft_p90_s" in d.inputs


def test_predictive_waits_before_scaling_down():
    policy = predictive(down_intervals=3, cooldown_s=0)
    kinds = [policy.decide(obs(t, arrival_rate=0.1, prefill=4, decode=4)).tiers[0] for t in (5, 10, 15)]
    assert [k.reason for k in kinds] == [Reason.SCALE_DOWN_PENDING] * 2 + [Reason.FORECAST]
    assert kinds[-1].desired == 1


def test_predictive_needs_a_profile():
    with pytest.raises(ValueError, match="profile"):
        make_policy(PlannerConfig(TARGETS, DISAGG, Mode.PREDICTIVE))


def test_a_decision_logs_as_json_with_its_inputs():
    d = predictive().decide(obs(5, ttft=None, arrival_rate=3.0))
    record = json.loads(json.dumps(d.to_json()))
    assert record["mode"] == "predictive"
    assert set(record["tiers"]) == {"prefill", "decode"}
    assert record["tiers"]["prefill"]["reason"] in {r.value for r in Reason}
    assert record["observation"]["workers"] == {"prefill": 2, "decode": 2}
    assert record["observation"]["ttft_p90_s"] is None
    assert record["inputs"]["forecast_rate"] == 3.0
