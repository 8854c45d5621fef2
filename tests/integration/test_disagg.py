"""Disaggregated prefill/decode as real processes (tiny model): KV moves over torch.distributed
gloo pair groups. Output equals the unified engine's; faults end as documented, without leaks."""

from __future__ import annotations

import signal
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from cluster_helpers import (
    engine_argv,
    engine_core_pid,
    greedy_request,
    kill_engine_core_mid_stream,
    metric,
    slow_sender_cluster,
    stub,
    tokens,
    wait_all_free,
    wait_gone,
)

from splitserve.common.sampling_params import SamplingParams
from splitserve.common.wire import params_to_proto
from splitserve.protos.v1 import worker_pb2 as wpb
from splitserve.protos.v1 import worker_pb2_grpc as wpb_grpc
from splitserve.services.engine.config import CacheConfig, EngineConfig
from splitserve.services.engine.llm import LLM
from splitserve.services.launcher.launcher import start_cluster, stop_cluster

PROMPTS = [[(7 * i + j) % 300 + 1 for j in range(4 + 13 * i)] for i in range(6)]  # 4..69 tokens
SEEDED = dict(temperature=0.8, top_p=0.95, seed=1234)


def _workers(children, prefix: str):
    return [c for c in children if c.name.startswith(prefix)]


def _in_process(folder, prompts, params: SamplingParams) -> list[list[int]]:
    cache = CacheConfig(block_size=8, kv_cache_bytes=4 * 1024**2)
    config = EngineConfig(model=str(folder), max_model_len=256, cache=cache)
    return [o.token_ids for o in LLM(config).generate(prompts, params)]


def _concurrent(address: str, requests) -> list[list[int]]:
    s = stub(address)
    with ThreadPoolExecutor(len(requests)) as pool:
        return list(pool.map(lambda r: tokens(s, r), requests))


@pytest.fixture(scope="module")
def one_p_one_d(tiny_llama_dir):
    children = start_cluster(1, engine_argv(tiny_llama_dir), num_prefill=1, num_decode=1)
    try:
        yield children
    finally:
        stop_cluster(children)


def test_1p1d_equals_unified_worker_and_in_process_engine(one_p_one_d, tiny_llama_dir):
    gateway, unified = one_p_one_d[0], _workers(one_p_one_d, "worker")[0]
    prefill, decode = _workers(one_p_one_d, "prefill")[0], _workers(one_p_one_d, "decode")[0]
    greedy = [greedy_request(p, 16) for p in PROMPTS]
    seeded = [greedy_request(p, 16, **SEEDED) for p in PROMPTS]
    got_greedy, got_seeded = _concurrent(gateway.address, greedy), _concurrent(gateway.address, seeded)
    assert got_greedy == _in_process(tiny_llama_dir, PROMPTS, SamplingParams(temperature=0.0, max_tokens=16))
    assert got_seeded == _in_process(tiny_llama_dir, PROMPTS, SamplingParams(max_tokens=16, **SEEDED))
    worker = wpb_grpc.WorkerStub(grpc.insecure_channel(unified.address))  # the unified worker, directly
    seeded_params = params_to_proto(SamplingParams(max_tokens=16, **SEEDED))  # as the gateway makes them
    direct = [
        [
            t
            for c in worker.Generate(
                wpb.WorkerGenerateRequest(request_id=f"u{i}", prompt_token_ids=r.token_ids.ids, params=seeded_params),
                timeout=60,
            )
            for t in c.token_ids
        ]
        for i, r in enumerate(seeded)
    ]
    assert direct == got_seeded
    # Every disaggregated request moved its KV: all through the decode worker, none unified.
    assert metric(decode.metrics, "splitserve_kv_transfer_blocks_total", direction="received") > 0
    assert metric(prefill.metrics, "splitserve_kv_transfer_bytes_total", direction="sent") == metric(
        decode.metrics, "splitserve_kv_transfer_bytes_total", direction="received"
    )
    # Each went out layer by layer while its prompt's last step computed (--kv-streaming, the default).
    assert metric(prefill.metrics, "splitserve_kv_transfers_streamed_total") == len(PROMPTS) + len(seeded)
    # Every transfer's CRC matched (a mismatch would count as a failure and recompute).
    assert metric(decode.metrics, "splitserve_kv_transfer_failures_total") == 0
    assert metric(decode.metrics, "splitserve_kv_transfer_recompute_fallbacks_total") == 0
    assert metric(unified.metrics, "splitserve_generation_tokens_total") == 16 * len(PROMPTS)  # the direct calls only
    assert wait_all_free([prefill.address, decode.address, unified.address])


def test_shared_prefix_sends_fewer_blocks(one_p_one_d):
    gateway, decode = one_p_one_d[0], _workers(one_p_one_d, "decode")[0]
    prefix = [11 + (j % 200) for j in range(48)]  # 6 full blocks of 8

    def received() -> float:
        return metric(decode.metrics, "splitserve_kv_transfer_blocks_total", direction="received")

    before = received()
    tokens(stub(gateway.address), greedy_request(prefix + [1, 2, 3], 4))
    first = received() - before
    skipped = metric(decode.metrics, "splitserve_kv_transfer_blocks_skipped_total")
    tokens(stub(gateway.address), greedy_request(prefix + [4, 5, 6, 7], 4))
    second = received() - before - first
    assert first == 7 and second == 1  # the second request only needed its last block
    assert metric(decode.metrics, "splitserve_kv_transfer_blocks_skipped_total") - skipped == 6


def test_2p2d_concurrent_requests_equal_in_process_engine(tiny_llama_dir):
    children = start_cluster(0, engine_argv(tiny_llama_dir), num_prefill=2, num_decode=2)
    try:
        requests = [greedy_request(p, 12) for p in PROMPTS] * 2
        got = _concurrent(children[0].address, requests)
        want = _in_process(tiny_llama_dir, PROMPTS, SamplingParams(temperature=0.0, max_tokens=12))
        assert got == want * 2
        for worker in children[1:]:  # both tiers' workers all took part
            assert metric(worker.metrics, "splitserve_kv_transfer_blocks_total") > 0, worker.name
        assert wait_all_free([c.address for c in children[1:]])
    finally:
        stop_cluster(children)


@pytest.fixture(scope="module")
def faulty(tiny_llama_dir):
    children = slow_sender_cluster(tiny_llama_dir, num_decode=2)
    try:
        yield children
    finally:
        stop_cluster(children)


def test_transfer_timeout_recomputes_on_decode_and_frees_everything(faulty, tiny_llama_dir):
    got = tokens(stub(faulty[0].address), greedy_request(PROMPTS[3], 10))
    assert got == _in_process(tiny_llama_dir, [PROMPTS[3]], SamplingParams(temperature=0.0, max_tokens=10))[0]
    decodes = _workers(faulty, "decode")
    assert sum(metric(d.metrics, "splitserve_kv_transfer_failures_total", reason="timeout") for d in decodes) >= 1
    assert sum(metric(d.metrics, "splitserve_kv_transfer_recompute_fallbacks_total") for d in decodes) >= 1
    assert wait_all_free([c.address for c in faulty[1:]])


def test_cancel_during_transfer_frees_both_sides(faulty):
    stream = stub(faulty[0].address).Generate(greedy_request(PROMPTS[4], 100), timeout=60)
    next(stream)  # the first token is out; the blocks wait in the slow sender
    stream.cancel()
    assert wait_all_free([c.address for c in faulty[1:]])


def test_killed_prefill_worker_during_transfer(faulty, tiny_llama_dir):
    s = stub(faulty[0].address)
    prefill = _workers(faulty, "prefill")[0]
    stream = s.Generate(greedy_request(PROMPTS[3], 10), timeout=60)
    first = next(stream)  # the first token is out; the sender is in its 3 s delay
    prefill.proc.send_signal(signal.SIGKILL)
    rest = [t for chunk in stream for t in chunk.token_ids]  # the decode worker recomputes the prompt
    want = _in_process(tiny_llama_dir, [PROMPTS[3]], SamplingParams(temperature=0.0, max_tokens=10))[0]
    assert list(first.token_ids) + rest == want
    # No prefill worker left: the request that finds it dead is retried, and decode workers run it whole.
    assert len(tokens(s, greedy_request([5, 6, 7], 4))) == 4
    alive = [c.address for c in faulty[1:] if c.proc.poll() is None]
    assert wait_all_free(alive)


@pytest.fixture(scope="module")
def core_tiers(tiny_llama_dir):
    """1P1D of its own (its test kills both workers' cores): the prefill worker computes prompts and
    sends their KV from its engine core, the decode worker receives it into its own."""
    children = start_cluster(0, engine_argv(tiny_llama_dir), num_prefill=1, num_decode=1)
    try:
        yield children
    finally:
        stop_cluster(children)


def _prefill_call(prompt: list[int], kv_layout: str) -> wpb.PrefillRequest:
    """A Prefill call as a decode worker makes one (a channel nobody listens on: it fails before it is used)."""
    channel = wpb.KVChannel(store_address="127.0.0.1:9", key="k", secret=b"s" * 32)
    request = wpb.WorkerGenerateRequest(prompt_token_ids=prompt)
    return wpb.PrefillRequest(request=request, channel=channel, kv_layout=kv_layout)


_TINY_KV_LAYOUT = "float32/layers=2/block=8/kv_heads=2/head_dim=16"  # tests/conftest.py's tiny Llama, block 8


def _abort_by_label_ends_a_prefill_call_in_the_core(prefill_stub: wpb_grpc.WorkerStub) -> None:
    """Worker.Abort by the client's id reaches a Prefill call the core runs: the call ends CANCELLED (its
    send, to a channel nobody listens on, would otherwise wait out the transfer timeout, then UNAVAILABLE)."""
    call = _prefill_call(PROMPTS[1], _TINY_KV_LAYOUT)
    call.request.request_id, call.transfer_tag = "abort-me", 1
    responses = prefill_stub.Prefill(call, timeout=60)
    next(responses)  # the prompt is computed; the call waits for its send
    assert prefill_stub.Abort(wpb.AbortRequest(request_id="abort-me"), timeout=30).aborted
    with pytest.raises(grpc.RpcError) as ended:
        list(responses)
    assert ended.value.code() == grpc.StatusCode.CANCELLED and "abort-me" in ended.value.details()


def test_workers_with_engine_processes_serve_like_the_engine_in_process(core_tiers, tiny_llama_dir):
    """Greedy and seeded (the decode core draws on from the prefill core's first token: draws keyed by position),
    many at once; the KV streamed layer by layer from the prefill core; a Prefill call this worker
    cannot serve refused INVALID_ARGUMENT; a stream cancelled after its first token; then the prefill
    worker killed: its core exits with it, the decode core refuses the next request UNAVAILABLE
    naming it, and the gateway's retry runs it whole; last, the decode worker's core killed mid-stream."""
    gateway, prefill, decode = core_tiers[0], _workers(core_tiers, "prefill")[0], _workers(core_tiers, "decode")[0]
    greedy = [greedy_request(p, 16) for p in PROMPTS]
    seeded = [greedy_request(p, 16, **SEEDED) for p in PROMPTS]
    assert _concurrent(gateway.address, greedy) == _in_process(
        tiny_llama_dir, PROMPTS, SamplingParams(temperature=0.0, max_tokens=16)
    )
    assert _concurrent(gateway.address, seeded) == _in_process(
        tiny_llama_dir, PROMPTS, SamplingParams(max_tokens=16, **SEEDED)
    )
    assert wait_all_free([prefill.address, decode.address])
    # the handoffs' metrics cross both pipes: what the decode core received, the prefill core sent
    landed = metric(decode.metrics, "splitserve_kv_transfer_blocks_total", direction="received")
    assert landed == metric(prefill.metrics, "splitserve_kv_transfer_blocks_total", direction="sent") > 0
    assert metric(prefill.metrics, "splitserve_kv_transfers_streamed_total") == 2 * len(PROMPTS)
    assert metric(prefill.metrics, "splitserve_request_success_total", finished_reason="length") == 2 * len(PROMPTS)

    prefill_stub = wpb_grpc.WorkerStub(grpc.insecure_channel(prefill.address))
    for call, why in ((_prefill_call(PROMPTS[1], "bogus"), "KV layout mismatch"), (_prefill_call([], ""), "prompt")):
        with pytest.raises(grpc.RpcError) as refused:
            list(prefill_stub.Prefill(call, timeout=30))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and why in refused.value.details()
    _abort_by_label_ends_a_prefill_call_in_the_core(prefill_stub)
    # its send, waiting to join a rendezvous nobody hosts, ends with the call and frees the prompt's blocks
    assert wait_all_free([prefill.address, decode.address])

    stream = stub(gateway.address).Generate(greedy_request(PROMPTS[5], 150), timeout=60)
    next(stream)
    stream.cancel()
    assert wait_all_free([prefill.address, decode.address])

    retries = metric(gateway.metrics, "splitserve_gateway_retries_total")
    prefill_core = engine_core_pid(prefill)
    prefill.proc.send_signal(signal.SIGKILL)
    prefill.proc.wait()  # the gateway still lists it (two failed health checks, a second apart, drop it)
    want = _in_process(tiny_llama_dir, [PROMPTS[2]], SamplingParams(temperature=0.0, max_tokens=8))[0]
    assert tokens(stub(gateway.address), greedy_request(PROMPTS[2], 8)) == want
    assert metric(gateway.metrics, "splitserve_gateway_retries_total") == retries + 1  # blamed on the prefill worker
    assert metric(decode.metrics, "splitserve_kv_transfer_failures_total", reason="prefill_failed") == 1
    assert wait_all_free([decode.address])
    assert wait_gone(prefill_core, 30)  # the prefill's core saw its pipe close: no orphan holds the model

    # its engine core killed mid-stream: UNAVAILABLE, and the decode worker exits 3 (what `up` restarts)
    stream = stub(gateway.address).Generate(greedy_request(PROMPTS[1], 200), timeout=60)
    next(stream)
    kill_engine_core_mid_stream(decode, stream)
