"""Latency as the client sees it, split by tier: a disaggregated request's final response carries
its time by stage (gateway queue, prefill queue and compute, KV transfer, decode queue, first
decode step), and the gateway's histograms count them (issue 22)."""

from __future__ import annotations

import urllib.request

from cluster_helpers import collect, engine_argv, greedy_request, stub

from splitserve.gateway.metrics import STAGES
from splitserve.services.launcher.launcher import start_cluster, stop_cluster

PROMPT = list(range(5, 45))  # five blocks of 8


def _metrics(address: str) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()
    return {k: float(v) for k, v in (line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))}


def test_stages_of_a_disaggregated_request_add_up(tiny_llama_dir):
    """Both workers' handoffs run in their engine cores: the cores' times cross the pipes."""
    children = start_cluster(0, engine_argv(tiny_llama_dir), num_prefill=1, num_decode=1)
    try:
        chunks = collect(stub(children[0].address), greedy_request(PROMPT, 6))
        metrics = _metrics(children[0].metrics)
    finally:
        stop_cluster(children)
    timings = chunks[-1].timings
    stages = {name: getattr(timings.stages, f"{name}_ms") for name in STAGES}
    assert all(ms > 0 for name, ms in stages.items() if name != "decode_queue"), stages
    assert stages["decode_queue"] >= 0
    # The first token left once the prefill worker had it: the stages before it fit in the TTFT.
    before_first = stages["gateway_queue"] + stages["prefill_queue"] + stages["prefill_compute"]
    assert before_first <= timings.ttft_ms
    # The stages after it follow one another and end before the last token; they start when the
    # prefill worker had the first token, not when the client got it (the KV moves while the first
    # token travels to the client), so they may overlap the TTFT.
    after_first = stages["kv_transfer"] + stages["decode_queue"] + stages["first_decode_step"]
    assert before_first + after_first <= timings.e2e_ms
    for name in STAGES:
        assert metrics[f'splitserve_gateway_request_stage_seconds_count{{stage="{name}"}}'] == 1, name
    assert metrics["splitserve_gateway_time_to_first_token_seconds_count"] == 1
    assert metrics["splitserve_gateway_e2e_request_latency_seconds_count"] == 1
    assert metrics["splitserve_gateway_time_per_output_token_seconds_count"] == 1
    num_chunks = sum(1 for c in chunks if c.token_ids)
    assert metrics["splitserve_gateway_inter_token_latency_seconds_count"] == num_chunks - 1
