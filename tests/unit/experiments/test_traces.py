"""Trace parsers on the shipped samples (experiments/trace_samples/), their filters, windows and errors, time
scaling, and workloads that replay each format."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest

from splitserve.experiments.traces import (
    SAMPLES_DIR,
    TraceConfig,
    detect_format,
    load_trace,
    scale_gaps,
    scale_to_rate,
)
from splitserve.experiments.workload import WorkloadConfig, arrival_offsets, make_requests

AZURE = str(SAMPLES_DIR / "azure_conv_sample.csv")
BURSTGPT = str(SAMPLES_DIR / "burstgpt_sample.csv")
JSONL = str(SAMPLES_DIR / "jsonl_sample.jsonl")
AZURE_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
BURSTGPT_HEADER = "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"


def _write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def _lengths(entries) -> list[tuple[int, int]]:
    return [(e.prompt_len, e.output_len) for e in entries]


def test_azure_sample_parses_with_seven_digit_timestamps():
    entries = load_trace(TraceConfig(AZURE, format="azure"))
    assert len(entries) == 40
    assert _lengths(entries[:2]) == [(844, 213), (1398, 67)] and _lengths(entries[-1:]) == [(3538, 35)]
    # 09:30:00.2500000, 09:30:00.6337930, ... 09:30:37.8823683, rebased to the first row
    assert [e.arrival_s for e in entries[:2]] == pytest.approx([0.0, 0.383793], abs=1e-6)
    assert entries[-1].arrival_s == pytest.approx(37.6323683, abs=1e-6)
    assert all(a.arrival_s <= b.arrival_s for a, b in zip(entries, entries[1:]))


def test_azure_2024_timestamps_with_offsets_and_whole_seconds(tmp_path):
    path = _write(
        tmp_path,
        "week.csv",
        AZURE_HEADER + "2024-05-12 00:00:00+00:00,1452,3\n2024-05-12 00:00:00.041683+00:00,584,3\n"
        "2024-05-12T01:00:00.5Z,862,38\n2024-05-12 02:00:00.0000001+01:00,10,1\n",
    )
    entries = load_trace(TraceConfig(path))  # in time order: 02:00+01:00 is 01:00 UTC, before 01:00:00.5Z
    assert [e.arrival_s for e in entries] == pytest.approx([0.0, 0.041683, 3600.0000001, 3600.5], abs=1e-6)
    assert [e.prompt_len for e in entries] == [1452, 584, 10, 862]


def test_burstgpt_sample_skips_failed_rows_unless_kept():
    entries = load_trace(TraceConfig(BURSTGPT, format="burstgpt"))
    assert len(entries) == 45  # 48 rows, 3 with Response tokens 0
    assert _lengths([entries[0], entries[-1]]) == [(1674, 24), (1170, 122)]
    assert entries[0].arrival_s == 0.0 and entries[-1].arrival_s == 399.0  # Timestamps 30605 .. 31004
    kept = load_trace(TraceConfig(BURSTGPT, keep_failed=True))
    assert len(kept) == 48
    assert (1565, 1) in _lengths(kept)  # line 11's failure (Response tokens 0) asks for one token


def test_burstgpt_filters_by_model_and_log_type():
    gpt4 = load_trace(TraceConfig(BURSTGPT, model="GPT-4"))
    assert len(gpt4) == 9
    api = load_trace(TraceConfig(BURSTGPT, model="GPT-4", log_type="API log"))
    assert _lengths(api) == [(1674, 24), (1607, 95), (1698, 395)]
    assert [e.arrival_s for e in api] == [0.0, 8.0, 38.0]
    assert len(load_trace(TraceConfig(BURSTGPT, log_type="Conversation log"))) == 33
    with pytest.raises(ValueError, match=r"none of its 48 rows.*\['ChatGPT', 'GPT-4'\]"):
        load_trace(TraceConfig(BURSTGPT, model="gpt-4"))
    with pytest.raises(ValueError, match="filter BurstGPT traces; this one is azure"):
        load_trace(TraceConfig(AZURE, model="GPT-4"))


def test_jsonl_sample_keeps_arrivals_and_prefix_ids():
    entries = load_trace(TraceConfig(JSONL))
    assert len(entries) == 12
    assert entries[0] == (0.0, 220, 10, None) and entries[1] == (0.161, 97, 45, 1)
    assert entries[-1] == (3.831, 207, 23, 1)


def test_formats_are_detected_from_the_first_line(tmp_path):
    assert [detect_format(p) for p in (AZURE, BURSTGPT, JSONL)] == ["azure", "burstgpt", "jsonl"]
    assert detect_format(_write(tmp_path, "a.csv", "\n Timestamp , CONTEXTTOKENS,GeneratedTokens\n")) == "azure"
    extra = "Timestamp,Session ID,Elapsed time,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
    assert detect_format(_write(tmp_path, "b.csv", extra)) == "burstgpt"  # newer columns are ignored
    with pytest.raises(ValueError, match="cannot tell the trace format.*trace_format"):
        detect_format(_write(tmp_path, "c.csv", "time,in,out\n1,2,3\n"))
    with pytest.raises(ValueError, match=r"azure_conv_sample.csv:1: a burstgpt trace needs the columns \['model'"):
        load_trace(TraceConfig(AZURE, format="burstgpt"))


@pytest.mark.parametrize(
    ("name", "text", "where"),
    [
        ("a.csv", AZURE_HEADER + "2023-11-16 18:15:46.6805900,374,44\n2023-11-16 18:15:50,lots,1\n", "a.csv:3: "),
        ("b.csv", AZURE_HEADER + "2023-11-16 18:15:46.6805900,374,44\n16/11/2023 18:15,1,1\n", "TIMESTAMP '16/11"),
        ("c.csv", BURSTGPT_HEADER + "5,ChatGPT,472,18,490,Conversation log\n9,GPT-4,-3,1,1,API log\n", "c.csv:3: "),
        ("d.csv", BURSTGPT_HEADER + "nan,ChatGPT,472,18,490,Conversation log\n", "d.csv:2: "),
        ("e.jsonl", '{"prompt_len": 3, "output_len": 1}\n\n{"prompt_len": 3\n', "e.jsonl:3: rows need"),
        (
            "f.jsonl",
            '{"prompt_len": 3, "output_len": 1, "arrival_s": 0}\n{"prompt_len": 3, "output_len": 1}\n',
            "or none",
        ),
    ],
)
def test_bad_rows_name_the_file_and_line(tmp_path, name, text, where):
    with pytest.raises(ValueError, match=where):
        load_trace(TraceConfig(_write(tmp_path, name, text)))


def test_windows_cut_in_trace_seconds_then_rebase(tmp_path):
    window = load_trace(TraceConfig(BURSTGPT, start_s=95, duration_s=100))  # Timestamps [30700, 30800)
    assert len(window) == 12 and window[0].arrival_s == 0.0 and window[-1].arrival_s == 92.0
    assert _lengths(window[:1]) == [(1624, 594)]
    assert len(load_trace(TraceConfig(BURSTGPT, start_s=95, max_rows=5))) == 5
    assert len(load_trace(TraceConfig(AZURE, max_rows=16))) == 16
    with pytest.raises(ValueError, match="needs rows with arrival_s"):
        load_trace(TraceConfig(_write(tmp_path, "untimed.jsonl", '{"prompt_len": 3, "output_len": 1}\n'), start_s=1))
    with pytest.raises(ValueError, match="max_rows must be at least 1"):
        TraceConfig(AZURE, max_rows=0)
    with pytest.raises(ValueError, match="trace format must be one of"):
        TraceConfig(AZURE, format="csv")


def test_time_scaling_arithmetic():
    assert scale_gaps([0.0, 1.0, 3.0], 0.5) == [0.0, 0.5, 1.5]  # gaps 1, 2 -> 0.5, 1
    scaled = scale_to_rate([0.0, 1.0, 3.0], rate=2.0)  # 2 gaps over 3 s -> 2 gaps over 1 s
    assert scaled == pytest.approx([0.0, 1 / 3, 1.0])
    assert scale_to_rate([0.0], rate=5.0) == [0.0]
    with pytest.raises(ValueError, match="arrive at once"):
        scale_to_rate([0.0, 0.0], rate=1.0)


def test_workloads_replay_each_format_deterministically():
    for path, num_rows in ((AZURE, 40), (BURSTGPT, 45), (JSONL, 12)):
        cfg = WorkloadConfig(trace=path, arrival="trace", time_scale=0.5, max_prompt_len=300, vocab_high=300)
        specs = make_requests(cfg)
        assert specs == make_requests(cfg) and len(specs) == num_rows
        entries = load_trace(TraceConfig(path))
        assert [len(s.prompt_token_ids) for s in specs] == [min(e.prompt_len, 300) for e in entries]
        assert [s.max_tokens for s in specs] == [e.output_len for e in entries]
        offsets = arrival_offsets(cfg, len(specs))
        assert offsets == pytest.approx([e.arrival_s * 0.5 for e in entries])
    at_rate = WorkloadConfig(trace=AZURE, trace_format="azure", arrival="trace", trace_at_rate=True, rate=2.0)
    offsets = arrival_offsets(at_rate, 40)
    assert offsets[0] == 0.0 and offsets[-1] == pytest.approx(39 / 2.0)  # 39 gaps at a mean of 2 req/s
    poisson = WorkloadConfig(trace=BURSTGPT, trace_model="GPT-4", max_output_len=50, vocab_high=300)
    specs = make_requests(poisson)  # the trace's lengths, the workload's own Poisson arrivals
    assert [(len(s.prompt_token_ids), s.max_tokens) for s in specs[:2]] == [(1674, 24), (1607, 50)]
    assert len(specs) == 9 and max(s.max_tokens for s in specs) == 50
    assert arrival_offsets(poisson, 9) == arrival_offsets(WorkloadConfig(), 9)


def test_workload_trace_settings_are_checked(tmp_path):
    untimed = _write(tmp_path, "untimed.jsonl", '{"prompt_len": 3, "output_len": 1}\n')
    with pytest.raises(ValueError, match="needs timestamps"):
        arrival_offsets(WorkloadConfig(trace=untimed, arrival="trace"), 1)
    with pytest.raises(ValueError, match="set trace"):
        WorkloadConfig(arrival="trace")
    with pytest.raises(ValueError, match="not both"):
        WorkloadConfig(trace=AZURE, arrival="trace", time_scale=2.0, trace_at_rate=True)
    with pytest.raises(ValueError, match="time_scale must be positive"):
        WorkloadConfig(trace=AZURE, time_scale=0)
    with pytest.raises(ValueError, match="at least 1"):
        WorkloadConfig(max_output_len=0)
    with pytest.raises(ValueError, match="trace format"):
        WorkloadConfig(trace=AZURE, trace_format="parquet")


def test_a_rewritten_trace_is_read_again(tmp_path):
    path = _write(tmp_path, "t.csv", AZURE_HEADER + "2023-11-16 18:15:46.6805900,374,44\n")
    assert _lengths(load_trace(TraceConfig(path))) == [(374, 44)]
    Path(path).write_text(AZURE_HEADER + "2023-11-16 18:15:46.6805900,375,45\n")
    os.utime(path, ns=(0, 10**9))  # a new mtime even where the clock is coarse
    assert _lengths(load_trace(TraceConfig(path))) == [(375, 45)]


def test_cpu_azure_trace_config_replays_the_sample(monkeypatch):
    from splitserve.experiments.experiment import load_config

    root = Path(__file__).resolve().parents[3]
    monkeypatch.chdir(root)  # the config names its trace from the repository root, as its comment says
    cfg = load_config(root / "experiments" / "configs" / "cpu-azure-trace.toml")
    (_, workload), rate = cfg.workloads[0], cfg.rates[0]
    specs = make_requests(workload)
    assert len(specs) == workload.trace_max_rows
    assert max(len(s.prompt_token_ids) for s in specs) <= workload.max_prompt_len
    offsets = arrival_offsets(replace(workload, rate=rate), len(specs))  # as the experiment's sweep does
    assert offsets[-1] == pytest.approx((len(specs) - 1) / rate)
