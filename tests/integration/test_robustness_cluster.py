"""Robustness across process boundaries (tiny model, real gateway and workers): a reused request
id never reaches another request's blocks, a poisonous request does not take a worker down, and
a worker whose engine loop dies leaves the cluster, exits non-zero and is started again."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from cluster_helpers import engine_argv, greedy_request, load, stub, tokens, wait_all_free
from poison import POISON_TOKEN

from splitserve.common.sampling_params import SamplingParams
from splitserve.protos.v1 import worker_pb2 as wpb
from splitserve.protos.v1 import worker_pb2_grpc as wpb_grpc
from splitserve.services.engine.config import CacheConfig, EngineConfig
from splitserve.services.engine.llm import LLM
from splitserve.services.launcher.launcher import free_port, start_cluster, stop_cluster, wait_healthy, wait_ready
from splitserve.services.launcher.supervisor import Supervisor
from splitserve.services.worker.server import SEND_DELAY_ENV

P = [(5 * j) % 290 + 3 for j in range(40)]  # 5 blocks of 8
Q = [(11 * j) % 290 + 7 for j in range(40)]


def _reference(folder, prompts, max_tokens) -> list[list[int]]:
    cache = CacheConfig(block_size=8, kv_cache_bytes=4 * 1024**2)
    config = EngineConfig(model=str(folder), max_model_len=256, cache=cache)
    return [o.token_ids for o in LLM(config).generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens))]


def _worker(children, prefix: str):
    return next(c for c in children if c.name.startswith(prefix))


@pytest.fixture(scope="module")
def slow_1p1d(tiny_llama_dir):
    """1P1D whose prefill worker waits 1 s before each send: KV stays held and in flight a while."""
    children = start_cluster(0, engine_argv(tiny_llama_dir), num_prefill=1, num_decode=1, env={SEND_DELAY_ENV: "1"})
    try:
        yield children
    finally:
        stop_cluster(children)


def test_reused_request_id_never_corrupts_the_prefix_cache(slow_1p1d, tiny_llama_dir):
    """A request that ends at its first token leaves its KV held on the prefill worker (sent 1 s
    later); a second request with the same id and another prompt arrives meanwhile. Before, the
    second one was computed into the first one's held, prefix-cached blocks, and later requests
    hitting that prefix got wrong tokens. Now every output equals the engine's."""
    gateway = stub(slow_1p1d[0].address)
    want_p, want_q = _reference(tiny_llama_dir, [P, Q], 8)

    def send(prompt, rid, max_tokens=8):
        request = greedy_request(prompt, max_tokens)
        request.request_id = rid
        return tokens(gateway, request)

    assert send(P, "dup", max_tokens=1) == want_p[:1]
    with ThreadPoolExecutor(2) as pool:  # while P's blocks are still held, and twice at once
        again = [pool.submit(send, Q, "dup"), pool.submit(send, P, "dup")]
        assert [f.result() for f in again] == [want_q, want_p]
    assert send(P, "fresh-1") == want_p
    assert send(Q, "fresh-2") == want_q
    addresses = [c.address for c in slow_1p1d[1:]]
    assert wait_all_free(addresses)
    assert all(load(a).num_held_blocks == 0 for a in addresses)


def test_out_of_vocab_stop_id_is_refused_and_the_worker_lives_on(slow_1p1d, tiny_llama_dir):
    """Straight to the decode worker (no gateway check in front): before, this raised inside step()
    and killed the worker's engine loop for good."""
    decode = _worker(slow_1p1d, "decode")
    worker = wpb_grpc.WorkerStub(grpc.insecure_channel(decode.address))
    bad = wpb.WorkerGenerateRequest(
        request_id="x",
        prompt_token_ids=P,
        params=wpb.EngineSamplingParams(temperature=0, max_tokens=4, min_tokens=2, stop_token_ids=[4294967295]),
    )
    with pytest.raises(grpc.RpcError) as e:
        list(worker.Generate(bad, timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "stop_token_ids" in e.value.details()
    assert tokens(stub(slow_1p1d[0].address), greedy_request(P, 8)) == _reference(tiny_llama_dir, [P], 8)[0]


# A worker whose engine core gets tests/poison.py's fault after its warm-up.
_POISONED_WORKER = """
import sys
from poison import poison_scheduler
from splitserve.services.engine.core_client import EngineCoreClient
real = EngineCoreClient.launch.__func__
EngineCoreClient.launch = classmethod(lambda cls, *a, **kw: real(cls, *a, prepare=poison_scheduler, **kw))
from splitserve.services.launcher.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_worker_whose_engine_loop_dies_leaves_the_cluster_and_exits(tiny_llama_dir):
    children = start_cluster(1, engine_argv(tiny_llama_dir))
    port = free_port("127.0.0.1")
    argv = [
        "worker",
        "--port",
        str(port),
        "--metrics-port",
        str(free_port("127.0.0.1")),
        "--gateway",
        children[0].address,
        *engine_argv(tiny_llama_dir),
    ]
    poisoned = subprocess.Popen(
        # Its log is not read: a pipe nobody drains would block the worker once full.
        [sys.executable, "-c", _POISONED_WORKER, *argv],
        env=dict(os.environ, PYTHONPATH=str(Path(__file__).parents[1])),  # poison.py, in the core too
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    address = f"127.0.0.1:{port}"
    try:
        wait_healthy(address, 60, poisoned)
        registry = wpb_grpc.RegistryStub(grpc.insecure_channel(children[0].address))
        deadline = time.monotonic() + 20
        while address not in [w.address for w in registry.ListWorkers(wpb.ListWorkersRequest(), timeout=5).workers]:
            assert time.monotonic() < deadline, "the poisoned worker never registered"
            time.sleep(0.2)
        worker = wpb_grpc.WorkerStub(grpc.insecure_channel(address))
        request = wpb.WorkerGenerateRequest(
            prompt_token_ids=[POISON_TOKEN, 1, 2], params=wpb.EngineSamplingParams(max_tokens=4)
        )
        with pytest.raises(grpc.RpcError) as e:
            list(worker.Generate(request, timeout=30))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "engine loop died" in e.value.details()
        assert poisoned.wait(timeout=30) == 3
        listed = [w.address for w in registry.ListWorkers(wpb.ListWorkersRequest(), timeout=5).workers]
        assert address not in listed
        # The rest of the cluster still serves.
        assert tokens(stub(children[0].address), greedy_request(P, 4)) == _reference(tiny_llama_dir, [P], 4)[0]
    finally:
        if poisoned.poll() is None:
            poisoned.kill()
        stop_cluster(children)


def test_up_restarts_a_crashed_worker(tiny_llama_dir):
    children = start_cluster(1, engine_argv(tiny_llama_dir))
    supervisor = Supervisor(children, engine_argv(tiny_llama_dir), "127.0.0.1")
    try:
        old = children[1]
        old.proc.kill()
        old.proc.wait()
        (new,) = supervisor.restart_crashed()
        wait_ready(new, 60)  # it binds a free port and says which
        assert new.name == old.name and new.mode == old.mode and new.address != old.address
        assert supervisor.restart_crashed() == []  # alive: nothing to do
        time.sleep(1.5)  # the gateway's next health check routes to it
        assert tokens(stub(children[0].address), greedy_request(P, 4)) == _reference(tiny_llama_dir, [P], 4)[0]
        assert wait_all_free([new.address])
    finally:
        stop_cluster(supervisor.children)
