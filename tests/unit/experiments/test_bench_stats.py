"""The benchmark's arithmetic on hand-made traces with known answers, and workload generation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from splitserve.experiments.stats import SLO, RequestRecord, percentile, summarize
from splitserve.experiments.workload import LengthDist, WorkloadConfig, arrival_offsets, make_requests


def _record(ttft: float, gaps: list[float], code: str = "OK", queue_ms: float = 0.0) -> RequestRecord:
    times = [ttft]
    for g in gaps:
        times.append(times[-1] + g)
    return RequestRecord(
        10, len(times), code=code, ttft_s=ttft, token_times_s=times, e2e_s=times[-1], queue_ms=queue_ms
    )


def test_tpot_itl_and_e2e_of_one_request():
    r = _record(0.5, [0.1, 0.2, 0.3])  # tokens at 0.5, 0.6, 0.8, 1.1
    assert r.output_tokens == 4
    assert r.tpot_s == pytest.approx((1.1 - 0.5) / 3)
    assert r.itls_s == pytest.approx([0.1, 0.2, 0.3])
    assert _record(0.5, []).tpot_s is None  # one token: no TPOT


def test_percentiles_interpolate_like_numpy():
    values = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    assert percentile(values, 50) == pytest.approx(5.5)
    assert percentile(values, 90) == pytest.approx(9.1)
    assert percentile(values, 99) == pytest.approx(9.91)
    assert percentile([42], 99) == 42 and percentile([], 50) is None


def test_goodput_counts_requests_meeting_both_objectives():
    records = [
        _record(0.2, [0.05, 0.05]),  # ttft 200, tpot 50: meets both
        _record(0.2, [0.2, 0.2]),  # tpot 200: misses tpot
        _record(0.9, [0.05, 0.05]),  # ttft 900: misses ttft
        _record(0.1, [0.01]),  # meets both
        RequestRecord(10, 5, code="UNAVAILABLE"),  # failed: never counts
    ]
    s = summarize(records, duration_s=2.0, slo=SLO(ttft_ms=500, tpot_ms=100))
    assert s.num_requests == 5 and s.num_ok == 4
    assert s.goodput == pytest.approx(2 / 2.0) and s.slo_attainment == pytest.approx(2 / 5)
    assert s.ttft_attainment == pytest.approx(3 / 5) and s.tpot_attainment == pytest.approx(3 / 5)
    assert s.request_throughput == pytest.approx(4 / 2.0)
    assert s.output_throughput == pytest.approx((3 + 3 + 3 + 2) / 2.0)
    assert s.errors == {"UNAVAILABLE": 1}
    assert s.ttft_ms["p50"] == pytest.approx(200) and s.ttft_ms["p99"] == pytest.approx(879)  # 200 + 0.97 * (900 - 200)
    json.dumps(s.to_dict())  # serializable as is


def test_slo_parsing():
    assert SLO.parse("ttft_ms=500,tpot_ms=50") == SLO(500, 50)
    assert SLO.parse("ttft_ms=500,attainment=0.99") == SLO(500, None, 0.99)
    with pytest.raises(ValueError, match="attainment"):
        SLO(attainment=1.5)
    assert SLO.parse("tpot_ms=20") == SLO(None, 20) and SLO.parse("") == SLO()
    with pytest.raises(ValueError, match="ttft_ms=N"):
        SLO.parse("latency=3")


def test_workload_lengths_prefixes_and_arrivals_are_deterministic():
    cfg = WorkloadConfig(
        num_requests=200,
        prompt_len=LengthDist.parse("uniform:20:40"),
        output_len=LengthDist.parse("normal:16:4"),
        shared_prefix_fraction=0.5,
        prefix_len=12,
        num_prefixes=3,
        seed=7,
        vocab_high=300,
    )
    a, b = make_requests(cfg), make_requests(cfg)
    assert a == b
    assert all(20 <= len(s.prompt_token_ids) <= 40 for s in a)
    shared = [s for s in a if s.prefix_id is not None]
    assert 60 < len(shared) < 140
    for s in shared:  # same prefix id, same leading tokens
        assert s.prompt_token_ids[:12] == next(x for x in shared if x.prefix_id == s.prefix_id).prompt_token_ids[:12]
    poisson = arrival_offsets(cfg, 200)
    assert poisson[0] == 0 and all(x <= y for x, y in zip(poisson, poisson[1:]))
    assert 200 / 4.0 * 0.7 < poisson[-1] < 200 / 4.0 * 1.3  # mean rate 4 req/s
    bursts = arrival_offsets(WorkloadConfig(arrival="burst", rate=2.0, burst_size=3), 7)
    assert bursts == [0, 0, 0, 0.5, 0.5, 0.5, 1.0]
    assert arrival_offsets(WorkloadConfig(arrival="concurrency"), 5) is None


def test_trace_replay(tmp_path):
    trace = tmp_path / "trace.jsonl"
    trace.write_text(
        '{"prompt_len": 30, "output_len": 5}\n{"prompt_len": 50, "output_len": 7, "prefix_id": 1}\n'
        '{"prompt_len": 40, "output_len": 3, "prefix_id": 1}\n'
    )
    specs = make_requests(WorkloadConfig(trace=str(trace), prefix_len=20, vocab_high=300))
    assert [len(s.prompt_token_ids) for s in specs] == [30, 50, 40] and [s.max_tokens for s in specs] == [5, 7, 3]
    assert specs[1].prompt_token_ids[:20] == specs[2].prompt_token_ids[:20]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": 3}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        make_requests(WorkloadConfig(trace=str(bad)))


def test_balanced_prefixes_get_equal_shares_in_random_order():
    cfg = WorkloadConfig(
        num_requests=24,
        prompt_len=LengthDist.parse("20"),
        shared_prefix_fraction=1.0,
        prefix_len=12,
        num_prefixes=4,
        prefix_assignment="balanced",
        vocab_high=300,
    )
    ids = [s.prefix_id for s in make_requests(cfg)]
    assert sorted(ids) == sorted(list(range(4)) * 6) and ids != [i % 4 for i in range(24)]
    with pytest.raises(ValueError, match="prefix_assignment"):
        WorkloadConfig(prefix_assignment="even")


def test_shipped_experiment_configs_load():
    from splitserve.experiments.experiment import load_config

    folder = Path(__file__).resolve().parents[3] / "experiments" / "configs"
    configs = {p.name: p for p in folder.glob("*.toml")}
    assert {"cpu-smollm2.toml", "gpu-8x.toml", "gpu-vs-vllm.toml"} <= set(configs)
    for path in configs.values():
        cfg = load_config(path)
        assert cfg.plan() and cfg.rates and cfg.workloads, path
    vs = {d.name: d for d in load_config(configs["gpu-vs-vllm.toml"]).deployments}
    assert vs["vllm"].endpoint == "http://127.0.0.1:8001" and vs["vllm"].protocol == "completions"
    assert vs["vllm"].budget == 1 and vs["splitserve 1P1D"].budget == 2
    assert vs["splitserve 1P1D"].endpoint is None and vs["splitserve 1P1D"].protocol == "completions"
    cpu = load_config(configs["cpu-smollm2.toml"])
    assert (cpu.sweep.repeats, cpu.sweep.duration_s, cpu.sweep.warmup_s, cpu.sweep.cooldown_s) == (3, 60, 10, 10)
    gpu = load_config(configs["gpu-8x.toml"])  # the P:D sweep's layouts are the listed unified x2 and 1P1D
    assert [d.name for d, _ in gpu.plan()] == ["unified x2", "1P1D", "1P2D", "2P1D"]


def test_deployments_are_a_cluster_shape_or_an_endpoint():
    from splitserve.experiments.experiment import Deployment

    assert Deployment("x", workers=1).protocol == "grpc"
    assert Deployment("y", endpoint="http://h:8000").protocol == "completions"
    with pytest.raises(ValueError, match="not both"):
        Deployment("both", workers=1, endpoint="http://h:8000")
    with pytest.raises(ValueError, match="or an endpoint"):
        Deployment("neither")
    with pytest.raises(ValueError, match="api must be"):
        Deployment("z", endpoint="http://h:8000", api="responses")
    with pytest.raises(ValueError, match="completions or chat"):
        Deployment("g", endpoint="http://h:8000", api="grpc")


def test_word_prompts_keep_shared_prefixes_shared():
    from splitserve.experiments.prompts import WORDS, word_prompt

    assert word_prompt([0, 1, len(WORDS)]) == f"{WORDS[0]} {WORDS[1]} {WORDS[0]}"
    assert word_prompt([5, 6, 7, 8]).startswith(word_prompt([5, 6]) + " ")
    assert len(word_prompt(range(100)).split()) == 100


def test_error_events_in_a_stream_name_their_code():
    from splitserve.experiments.loadgen import _stream_error

    assert _stream_error({"choices": [{"text": "hi"}], "usage": None}) is None
    assert _stream_error({"error": {"message": "m", "type": "server_error", "code": 500}}).code == "stream error: 500"
    assert _stream_error({"object": "error", "message": "m", "type": "BadRequestError"}).code == (
        "stream error: BadRequestError"
    )
    assert _stream_error({"error": "overloaded"}).code == "stream error: unknown"
