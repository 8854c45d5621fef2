"""Gateway + workers as real processes on 127.0.0.1 (tiny model): output, streaming, cancel,
bad input, worker death, metrics, health and reflection."""

from __future__ import annotations

import os
import signal
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from cluster_helpers import (
    all_blocks_free,
    collect,
    engine_argv,
    greedy_request,
    kill_engine_core,
    metric,
    stub,
    tokens,
    wait_all_free,
)
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitserve.common.sampling_params import SamplingParams
from splitserve.common.serving import free_port
from splitserve.protos.v1 import generation_pb2 as pb
from splitserve.protos.v1 import worker_pb2 as wpb
from splitserve.protos.v1 import worker_pb2_grpc as wpb_grpc
from splitserve.services.engine.config import CacheConfig, EngineConfig
from splitserve.services.engine.llm import LLM
from splitserve.services.launcher.launcher import _spawn, start_cluster, stop_cluster, wait_healthy

KV_BYTES = 4 * 1024**2
_engine_argv = engine_argv
_stub, _greedy_request, _collect, _all_blocks_free = stub, greedy_request, collect, all_blocks_free


def _num_tokens(stub_, request) -> int:
    return len(tokens(stub_, request))


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir):
    """Two unified workers; every request crosses the pipe to a worker's engine core and back."""
    children = start_cluster(2, _engine_argv(tiny_llama_dir))
    try:
        yield children
    finally:
        stop_cluster(children)


def test_concurrent_greedy_output_equals_in_process_engine(cluster, tiny_llama_dir):
    prompts = [[(7 * i + j) % 300 + 1 for j in range(5 + 9 * i)] for i in range(6)]
    stub = _stub(cluster[0].address)
    with ThreadPoolExecutor(6) as pool:
        streams = list(pool.map(lambda p: _collect(stub, _greedy_request(p, 20)), prompts))
    got = [[t for chunk in s for t in chunk.token_ids] for s in streams]
    llm = LLM(EngineConfig(model=str(tiny_llama_dir), cache=CacheConfig(block_size=8, kv_cache_bytes=KV_BYTES)))
    want = [o.token_ids for o in llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=20))]
    assert got == want
    last = streams[0][-1]
    assert last.finish_reason == pb.FINISH_REASON_LENGTH
    assert last.usage.prompt_tokens == 5 and last.usage.completion_tokens == 20
    assert last.timings.ttft_ms > 0 and last.timings.e2e_ms >= last.timings.ttft_ms


def test_tokens_stream_incrementally(cluster):
    arrivals = []
    for chunk in _stub(cluster[0].address).Generate(_greedy_request([1, 2, 3], 60), timeout=60):
        arrivals.append((time.monotonic(), len(chunk.token_ids)))
    assert len(arrivals) > 5  # streamed as steps finish, not in one message at the end
    assert arrivals[-1][0] - arrivals[0][0] > 0


def test_text_and_chat_prompts_and_tokenize(cluster):
    stub = _stub(cluster[0].address)
    text = _collect(stub, pb.GenerateRequest(text="the quick brown fox", stopping=pb.StoppingCriteria(max_tokens=5)))
    assert sum(len(c.token_ids) for c in text) == 5
    ids = stub.Tokenize(pb.TokenizeRequest(text="the quick brown fox")).token_ids
    assert len(ids) > 0 and text[-1].usage.prompt_tokens == len(ids)
    models = stub.ListModels(pb.ListModelsRequest()).models
    assert models[0].max_model_len == 256


def test_cancel_frees_the_workers_kv_blocks(cluster):
    stream = _stub(cluster[0].address).Generate(_greedy_request([5] * 40, 200), timeout=60)
    for i, _ in enumerate(stream):
        if i == 2:
            stream.cancel()
            break
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not all(_all_blocks_free(w.address) for w in cluster[1:]):
        time.sleep(0.1)
    assert all(_all_blocks_free(w.address) for w in cluster[1:])


@pytest.mark.parametrize(
    "request_, message",
    [
        (pb.GenerateRequest(text=""), "prompt is empty"),
        (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[])), "prompt is empty"),
        (pb.GenerateRequest(model="gpt-9", text="hi"), "unknown model 'gpt-9'"),
        (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1] * 300)), "model context is 256"),
        (pb.GenerateRequest(text="hi", sampling=pb.SamplingParameters(top_p=1.5)), "top_p must be in"),
        (pb.GenerateRequest(text="hi", sampling=pb.SamplingParameters(temperature=-1)), "temperature must be"),
        (pb.GenerateRequest(text="hi", stopping=pb.StoppingCriteria(max_tokens=0)), "max_tokens must be >= 1"),
        (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 99999])), "token ids must be in"),
    ],
)
def test_bad_input_gets_invalid_argument(cluster, request_, message):
    stub = _stub(cluster[0].address)
    with pytest.raises(grpc.RpcError) as err:
        _collect(stub, request_)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.details()
    assert _num_tokens(stub, _greedy_request([1, 2], 3)) == 3  # still serving


def test_health_reflection_and_metrics(cluster):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    for child in cluster:
        channel = grpc.insecure_channel(child.address)
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status
        assert status == health_pb2.HealthCheckResponse.SERVING
        replies = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
        )
        names = {s.name for r in replies for s in r.list_services_response.service}
        assert "grpc.health.v1.Health" in names
        assert ("splitserve.v1.Generation" if child.name == "gateway" else "splitserve.v1.Worker") in names
    _collect(_stub(cluster[0].address), _greedy_request([3, 4, 5], 8))
    text = "".join(
        urllib.request.urlopen(f"http://{w.metrics}/metrics", timeout=5).read().decode() for w in cluster[1:]
    )
    for series in (
        "time_to_first_token_seconds",
        "inter_token_latency_seconds",
        "request_time_per_output_token_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
        "request_prefill_time_seconds",
        "request_decode_time_seconds",
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "prefix_cache_queries_total",
        "prefix_cache_hits_total",
        "num_preemptions_total",
        "prompt_tokens_total",
        "generation_tokens_total",
        "request_success_total",
    ):
        assert f"splitserve_{series}" in text, series
    generated = sum(
        float(line.split()[-1]) for line in text.splitlines() if line.startswith("splitserve_generation_tokens_total")
    )
    assert generated >= 8
    gateway = urllib.request.urlopen(f"http://{cluster[0].metrics}/metrics", timeout=5).read().decode()
    assert 'splitserve_gateway_requests_total{code="OK"}' in gateway
    assert "splitserve_gateway_routing_decisions_total" in gateway


def _start_gateway(extra: list[str]):
    port, metrics = free_port(), free_port()
    proc = _spawn(
        "gateway-x", ["gateway", "--port", str(port), "--metrics-port", str(metrics), *extra], dict(os.environ)
    )
    wait_healthy(f"127.0.0.1:{port}", 60, proc)
    return proc, f"127.0.0.1:{port}"


def test_no_worker_is_unavailable_and_queue_limit_is_resource_exhausted(cluster, tiny_llama_dir):
    lonely, address = _start_gateway(["--model", str(tiny_llama_dir)])
    try:
        with pytest.raises(grpc.RpcError) as err:
            _collect(_stub(address), _greedy_request([1, 2], 3))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "no healthy worker" in err.value.details()
    finally:
        lonely.terminate()
        lonely.wait(10)
    workers = [a for w in cluster[1:] for a in ("--worker", w.address)]
    small, address = _start_gateway(["--model", str(tiny_llama_dir), "--max-pending", "1", *workers])
    try:
        time.sleep(1.5)  # first health-check round
        stub = _stub(address)
        long_stream = stub.Generate(_greedy_request([9] * 10, 200), timeout=60)
        next(long_stream)
        with pytest.raises(grpc.RpcError) as err:
            _collect(stub, _greedy_request([1, 2], 3))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-pending" in err.value.details()
        long_stream.cancel()
    finally:
        small.terminate()
        small.wait(10)


def test_abort_by_the_clients_id_ends_the_workers_stream(cluster):
    """Worker.Abort, for callers that cannot cancel a stream: the stream with that id ends with finish
    reason abort (it stayed open for ever before), its blocks are freed, the worker serves on."""
    worker = cluster[1]
    w = wpb_grpc.WorkerStub(grpc.insecure_channel(worker.address))
    request = wpb.WorkerGenerateRequest(
        request_id="abort-me",
        prompt_token_ids=[5, 6, 7],
        params=wpb.EngineSamplingParams(max_tokens=240, ignore_eos=True),
    )
    stream = w.Generate(request, timeout=60)
    next(stream)
    assert w.Abort(wpb.AbortRequest(request_id="abort-me"), timeout=5).aborted
    rest = list(stream)  # ends (a hang here fails by the call's timeout)
    assert rest[-1].finish_reason == pb.FINISH_REASON_ABORT and len(rest) < 200
    assert not w.Abort(wpb.AbortRequest(request_id="abort-me"), timeout=5).aborted  # nothing left by that id
    assert wait_all_free([worker.address])


def test_killed_worker_moves_its_in_flight_stream_and_traffic_moves(tiny_llama_dir):
    """SIGKILL the worker streaming a request: the client's stream goes on from the other worker
    (the gateway moves it with the tokens so far) and ends with exactly the unfaulted tokens."""
    children = start_cluster(2, _engine_argv(tiny_llama_dir))
    try:
        stub = _stub(children[0].address)
        request = _greedy_request([4] * 20, 200)
        stream = stub.Generate(request, timeout=60)
        got = list(next(stream).token_ids)
        busy = next(w for w in children[1:] if not _all_blocks_free(w.address))
        busy.proc.send_signal(signal.SIGKILL)
        got += [t for chunk in stream for t in chunk.token_ids]
        assert got == tokens(stub, request)  # the same request again, unfaulted, on the survivor
        assert metric(children[0].metrics, "splitserve_gateway_migrations_total", outcome="resumed") == 1
        for _ in range(4):  # new requests go to the surviving worker
            assert _num_tokens(stub, _greedy_request([1, 2, 3], 4)) == 4
    finally:
        stop_cluster(children)


def test_a_killed_engine_core_takes_its_worker_down_cleanly(tiny_llama_dir):
    """SIGKILL the engine core of a worker, mid-request: its stream moves to the other worker (the
    client sees every token once), the worker leaves the gateway and exits 3 (what `up` restarts);
    traffic moves."""
    children = start_cluster(2, _engine_argv(tiny_llama_dir))
    try:
        gateway, workers = children[0], children[1:]
        stub = _stub(gateway.address)
        request = _greedy_request([4] * 20, 200)
        stream = stub.Generate(request, timeout=60)
        got = list(next(stream).token_ids)
        busy: list = []
        for _ in range(100):  # the load came with the first token's step (the loop is only a margin)
            busy = [w for w in workers if not _all_blocks_free(w.address)]
            if busy:
                break
            time.sleep(0.05)
        (victim,) = busy
        survivor = next(w for w in workers if w is not victim)
        kill_engine_core(victim)
        got += [t for chunk in stream for t in chunk.token_ids]
        assert victim.proc.wait(30) == 3
        registry = wpb_grpc.RegistryStub(grpc.insecure_channel(gateway.address))
        listed = [w.address for w in registry.ListWorkers(wpb.ListWorkersRequest(), timeout=5).workers]
        assert listed == [survivor.address]  # it deregistered before exiting
        assert got == tokens(stub, request)
        assert _num_tokens(stub, _greedy_request([1, 2, 3], 4)) == 4
    finally:
        stop_cluster(children)
