"""The load generator's OpenAI HTTP client against a real splitserve gateway's OpenAI API (tiny Llama
with a chat template, API keys on): completions and chat streams counted exactly with ignore_eos,
TTFT and per-token times recorded, HTTP errors as failed records, `splitserve bench --backend openai`,
and `splitserve experiment` with a deployment that is only an endpoint beside one it starts and
measures through its gateway's chat API.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from cluster_helpers import engine_argv, write_chat_model

from splitserve.__main__ import main
from splitserve.common.serving import free_port
from splitserve.experiments.experiment import load_config, run_experiment
from splitserve.experiments.loadgen import OpenAIConfig, run_connected
from splitserve.experiments.workload import LengthDist, WorkloadConfig, make_requests
from splitserve.services.launcher.launcher import start_cluster, stop_cluster

KEY = "sk-bench"
WORKLOAD = WorkloadConfig(
    num_requests=6,
    arrival="concurrency",
    concurrency=3,
    prompt_len=LengthDist("uniform", 8, 40),
    output_len=LengthDist("fixed", 7),
    shared_prefix_fraction=0.5,
    prefix_len=6,
    vocab_high=300,
)


@pytest.fixture(scope="module")
def chat_model(tiny_llama_dir, tmp_path_factory):
    return write_chat_model(tiny_llama_dir, tmp_path_factory.mktemp("bench-openai") / "tiny-llama-chat")


@pytest.fixture(scope="module")
def base_url(chat_model):
    keys = chat_model.parent / "keys"
    keys.write_text(f"{KEY} name=bench\n")
    children = start_cluster(1, engine_argv(chat_model), gateway_argv=["--api-key-file", str(keys)])
    try:
        yield f"http://{children[0].http}"
    finally:
        stop_cluster(children)


def _run(config: OpenAIConfig, workload: WorkloadConfig = WORKLOAD):
    records, seconds = asyncio.run(run_connected(config.connect, workload))
    assert seconds > 0
    return records


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_streams_count_every_token_and_time_the_first(base_url, endpoint):
    records = _run(OpenAIConfig(base_url, endpoint, api_key=KEY))
    assert [r.code for r in records] == ["OK"] * 6
    for r in records:
        assert r.output_tokens == r.max_tokens == 7  # ignore_eos: the whole length, from the usage chunk
        assert 0 < r.ttft_s == r.token_times_s[0] <= r.token_times_s[-1] <= r.e2e_s
        assert r.token_times_s == sorted(r.token_times_s)
    if endpoint == "completions":  # token-id prompts: the server saw (usage) exactly the workload's lengths
        assert [r.prompt_tokens for r in records] == [len(s.prompt_token_ids) for s in make_requests(WORKLOAD)]


def test_chat_prompts_are_about_the_requested_length(base_url):
    """Chat takes text: the prompts are fitted with /tokenize + /detokenize; usage reports the real length."""
    requested = [len(s.prompt_token_ids) for s in make_requests(WORKLOAD)]
    records = _run(OpenAIConfig(base_url, "chat", api_key=KEY))
    for want, r in zip(requested, records):
        assert abs(r.prompt_tokens - want) <= max(3, want // 5), (want, r.prompt_tokens)


def test_http_errors_are_failed_records(base_url):
    records = _run(OpenAIConfig(base_url, "completions", model="any", api_key="sk-wrong"))
    assert {r.code for r in records} == {"HTTP 401"} and len(records) == 6
    assert all(r.ttft_s is None and r.output_tokens == 0 for r in records)
    with pytest.raises(RuntimeError, match="HTTP 401"):  # no model named: asking /v1/models fails loudly
        _run(OpenAIConfig(base_url, "completions", api_key="sk-wrong"))
    nobody = OpenAIConfig(f"http://127.0.0.1:{free_port()}", model="any")
    assert {r.code for r in _run(nobody)} == {"ConnectError"}


def test_bench_cli_with_the_openai_backend(base_url, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    out = tmp_path / "bench.json"
    argv = ["bench", "--backend", "openai", "--base-url", f"{base_url}/v1", "--endpoint", "chat"]
    argv += ["--num-requests", "4", "--arrival", "poisson", "--rate", "20", "--prompt-len", "16"]
    argv += ["--output-len", "5", "--vocab-size", "300", "--json", str(out), "--no-progress"]
    assert main(argv) == 0
    assert "4/4 ok" in capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["settings"]["backend"] == "openai" and report["settings"]["endpoint"] == "chat"
    assert [r["max_tokens"] for r in report["requests"]] == [5] * 4
    assert all(len(r["token_times_s"]) == 5 for r in report["requests"])


def test_experiment_sends_to_an_endpoint_deployment(base_url, chat_model, tmp_path, monkeypatch):
    """The running gateway as an endpoint (nothing started for it), beside a cluster the experiment starts
    and measures through its gateway's chat API."""
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    config = tmp_path / "endpoint.toml"
    config.write_text(f"""
name = "endpoint"
engine_args = {json.dumps(engine_argv(chat_model))}
warmup_requests = 1
[[deployments]]
name = "running gateway"
endpoint = "{base_url}"
api = "completions"
[[deployments]]
name = "started, chat"
workers = 1
api = "chat"
[sweep]
rates = [10.0]
[[workloads]]
name = "short"
num_requests = 3
prompt_len = "30"
output_len = "4"
vocab_high = 300
""")
    runs = run_experiment(load_config(config), tmp_path / "report")
    assert [(r["deployment"], r["api"], r["endpoint"]) for r in runs] == [
        ("running gateway", "completions", base_url),
        ("started, chat", "chat", None),
    ]
    assert all(r["summary"]["num_ok"] == 3 and r["cpu_sets"] is None for r in runs)
    assert all(len(record["token_times_s"]) == 4 for r in runs for record in r["records"])
    summary = (tmp_path / "report" / "summary.md").read_text()
    assert "| running gateway | 10.0 | 3/3 |" in summary and "| started, chat | 10.0 | 3/3 |" in summary
