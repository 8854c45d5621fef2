"""The performance profile: fits, the file, the online refit, and `splitserve profile` on the tiny model."""

from __future__ import annotations

import json

import pytest

from splitserve.services.planner.profile import (
    LinearModel,
    OnlineFit,
    Point,
    Profile,
    RefinedProfile,
    WorkerLimits,
    decode_features,
    fit,
    prefill_features,
)

PREFILL = LinearModel((0.01, 1e-4, 1e-8))
DECODE = LinearModel((0.02, 5e-4, 2e-7))


def _profile(**limits) -> Profile:
    return Profile(PREFILL, DECODE, WorkerLimits(**({"max_num_batched_tokens": 4096, "max_num_seqs": 64} | limits)))


def test_fit_recovers_the_coefficients_of_exact_points():
    points = [
        Point(prefill_features([n] * k), PREFILL.predict(prefill_features([n] * k)))
        for n in (64, 512, 2048)
        for k in (1, 2)
    ]
    assert fit(points).coef == pytest.approx(PREFILL.coef, rel=1e-6)


def test_fit_keeps_every_coefficient_non_negative():
    """Times that fall with batch size would fit a negative slope: the cost is clamped at zero instead."""
    points = [Point(decode_features(b, 100), 0.05 - 0.001 * b) for b in (1, 8, 16, 32)]
    model = fit(points)
    assert min(model.coef) >= 0
    assert model.predict(decode_features(1, 100)) > 0


def test_chunks_of_a_prompt_add_up_to_the_prompt_alone():
    """attention_tokens2 telescopes over chunks, so a chunked prompt costs its steps' fixed parts more."""
    profile = _profile(max_num_batched_tokens=1000)
    chunks = [profile.prefill_step_s([1000], [1000 * (i + 1)]) for i in range(3)]
    assert profile.prefill_request_s(3000) == pytest.approx(sum(chunks))


def test_prefill_rate_packs_short_prompts_into_one_step():
    profile = _profile()
    assert profile.prefill_rate(512) == pytest.approx(8 / profile.prefill_step_s([512] * 8))
    assert profile.prefill_rate(8192) == pytest.approx(1 / profile.prefill_request_s(8192))


def test_profile_file_round_trips_and_refuses_another_version(tmp_path):
    points = (Point(prefill_features([128]), 0.02),)
    profile = Profile(PREFILL, DECODE, WorkerLimits(2048, 32, 10_000), points, (), {"model": "tiny"})
    path = tmp_path / "profile.json"
    profile.save(path)
    assert Profile.load(path) == profile
    data = json.loads(path.read_text())
    data["version"] = 99
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="splitserve profile"):
        Profile.load(path)


def test_online_fit_moves_to_what_is_observed():
    """The deployment's steps take twice the profile's time: after a window of them the model agrees."""
    prior_points = [
        Point(decode_features(b, c), DECODE.predict(decode_features(b, c))) for b in (1, 8, 32) for c in (256, 1024)
    ]
    online = OnlineFit(DECODE, prior_points, window=64)
    observed = [
        Point(decode_features(b, c), 2 * DECODE.predict(decode_features(b, c)))
        for b in (2, 4, 16, 48)
        for c in (300, 800, 2000)
    ]
    for _ in range(6):
        online.add(observed)
    assert online.model.predict(decode_features(24, 600)) == pytest.approx(
        2 * DECODE.predict(decode_features(24, 600)), rel=0.15
    )


def test_online_fit_without_prior_points_waits_for_enough_observations():
    online = OnlineFit(DECODE)
    online.add([Point(decode_features(4, 100), 1.0)])
    assert online.model == DECODE


def test_refined_profile_keeps_the_limits():
    refined = RefinedProfile(_profile(kv_capacity_tokens=5000))
    refined.add([], [Point(decode_features(b, 100), 0.1) for b in range(1, 10)])
    assert refined.current().limits.kv_capacity_tokens == 5000
    assert refined.current().decode != DECODE


def test_measure_profile_on_the_tiny_model(tiny_llama_dir, tmp_path):
    from splitserve.services.engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from splitserve.services.engine.engine import Engine
    from splitserve.services.planner.profiler import ProfileGrid, measure_profile

    config = EngineConfig(
        model=str(tiny_llama_dir),
        device="cpu",
        max_model_len=128,
        cache=CacheConfig(block_size=16, kv_cache_bytes=64 * 16 * 2 * 2 * 2 * 16 * 4),  # 64 blocks
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64),
    )
    engine = Engine(config)
    try:
        grid = ProfileGrid(prefill_lens=(16, 96), decode_batches=(1, 4), decode_contexts=(32,), repeats=2)
        profile = measure_profile(engine, grid)
    finally:
        engine.close()
    # 16: alone and 4 to a step; 96 > the 64-token budget: its last chunk
    assert [p.features[1] for p in profile.prefill_points] == [16, 64, 64]
    assert [p.features[1] for p in profile.decode_points] == [1, 4]
    assert all(p.seconds > 0 for p in profile.prefill_points + profile.decode_points)
    assert profile.limits == WorkerLimits(64, 4, 64 * 16)
    profile.save(tmp_path / "p.json")
    assert Profile.load(tmp_path / "p.json").decode == profile.decode
