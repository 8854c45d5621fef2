"""Tensor parallelism inside a worker (services/engine/ranks.py): follower rank processes over gloo, the KV cache
sharded by KV head, KV handed off rank to rank between tiers of different sizes, and a lost rank
ending its worker. The model's sharding itself is tests/unit/model/test_tp_model.py; the handoff's plan for every
pair of sizes, tests/unit/disagg/test_handoff_plan.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import grpc
import pytest
from cluster_helpers import engine_argv, greedy_request, metric, stub, tokens, wait_all_free

from splitserve.common.sampling_params import SamplingParams
from splitserve.protos.v1 import worker_pb2 as wpb
from splitserve.protos.v1 import worker_pb2_grpc as wpb_grpc
from splitserve.services.disagg.plan import handoff_plan
from splitserve.services.engine.config import CacheConfig, EngineConfig
from splitserve.services.engine.llm import LLM
from splitserve.services.engine.ranks import RanksLost
from splitserve.services.launcher.launcher import start_cluster, stop_cluster
from splitserve.services.worker.server import SEND_DELAY_ENV

PROMPTS = [[(5 * i + j) % 300 + 1 for j in range(3 + 11 * i)] for i in range(5)]  # 3..47 tokens
SEEDED = dict(temperature=0.8, top_p=0.95, seed=7)


def _llm(folder, tp: int, **overrides) -> LLM:
    cache = CacheConfig(block_size=8, kv_cache_bytes=4 * 1024**2)
    return LLM(EngineConfig(model=str(folder), max_model_len=256, cache=cache, tensor_parallel_size=tp, **overrides))


def _generate(llm: LLM, params: SamplingParams) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(PROMPTS, params)]


@pytest.mark.parametrize("fixture", ["tiny_llama_dir", "tiny_qwen2_dir"])
def test_two_ranks_generate_what_one_does(fixture, request):
    """Greedy and seeded output with the model split over 2 ranks (fp32) equals 1 rank's, token for
    token: Llama (separate LM head) and Qwen2 (tied embeddings, q/k/v biases)."""
    folder = request.getfixturevalue(fixture)
    greedy, seeded = SamplingParams(temperature=0.0, max_tokens=12), SamplingParams(max_tokens=12, **SEEDED)
    one = _llm(folder, 1)
    expected = _generate(one, greedy), _generate(one, seeded)
    two = _llm(folder, 2)
    try:
        assert (_generate(two, greedy), _generate(two, seeded)) == expected
        # Per rank: the KV cache holds that rank's KV head (of 2); its blocks are as many as rank 0's.
        assert two.engine.runner.kv_cache.shape[4] == 1 and one.engine.runner.kv_cache.shape[4] == 2
    finally:
        two.engine.close()


def test_a_lost_rank_fails_the_engine_not_one_batch(tiny_llama_dir):
    llm = _llm(tiny_llama_dir, 2)
    try:
        (follower,) = llm.engine.runner.followers._procs
        follower.kill()
        follower.join(10)
        with pytest.raises(RanksLost):
            _generate(llm, SamplingParams(temperature=0.0, max_tokens=4))
    finally:
        llm.engine.close()


@pytest.mark.parametrize(
    "sizes",
    [(2, 1), (1, 2), (2, 2), (4, 2)],
    ids=["prefill2-decode1", "prefill1-decode2", "2-2", "prefill4-decode2"],
)
def test_handoff_between_tiers_of_different_sizes(sizes, tiny_llama_dir):
    """1P1D with a prefill tier of one size and a decode tier of another: output equals the unified
    in-process engine's (greedy and seeded), nothing recomputed or leaked, and each rank moved exactly
    its own pieces' bytes (tests/unit/disagg/test_handoff_plan.py covers the plan of all nine pairs; these cover
    each direction, equal sizes, and replicated heads on the prefill side: 4 ranks over 2 KV heads).
    Both workers' engine cores lead the follower ranks and order their sends and receives."""
    prefill_tp, decode_tp = sizes
    children = start_cluster(
        0,
        engine_argv(tiny_llama_dir),
        num_prefill=1,
        num_decode=1,
        tp_sizes={"prefill": prefill_tp, "decode": decode_tp},
    )
    try:
        gateway, prefill, decode_worker = children
        s = stub(gateway.address)
        got = [tokens(s, greedy_request(p, 10)) for p in PROMPTS] + [
            tokens(s, greedy_request(p, 10, **SEEDED)) for p in PROMPTS
        ]
        one = _llm(tiny_llama_dir, 1)
        expected = _generate(one, SamplingParams(temperature=0.0, max_tokens=10))
        expected += _generate(one, SamplingParams(max_tokens=10, **SEEDED))
        assert got == expected
        assert metric(decode_worker.metrics, "splitserve_kv_transfer_blocks_total", direction="received") > 0
        assert metric(decode_worker.metrics, "splitserve_kv_transfer_recompute_fallbacks_total") == 0
        # Every rank streamed its pieces as the prompt's last step computed them (--kv-streaming).
        assert metric(prefill.metrics, "splitserve_kv_transfers_streamed_total") == len(got)
        _check_rank_bytes(prefill.metrics, decode_worker.metrics, prefill_tp, decode_tp)
        assert wait_all_free([prefill.address, decode_worker.address])
    finally:
        stop_cluster(children)


def test_a_failed_piece_fails_the_handoff_and_the_decode_tier_recomputes(tiny_llama_dir):
    """2P2D whose prefill worker waits 3 s before sending, with 1.5 s transfer timeouts: rank 0's
    receive times out (the follower's piece, streamed as its step computes it, may arrive), the
    decode worker recomputes the prompt (same tokens), nothing leaks."""
    children = start_cluster(
        0,
        engine_argv(tiny_llama_dir),
        num_prefill=1,
        num_decode=1,
        worker_argv=["--kv-transfer-timeout", "1.5"],
        env={SEND_DELAY_ENV: "3"},
        tp_sizes={"prefill": 2, "decode": 2},
    )
    try:
        gateway, prefill, decode_worker = children
        got = tokens(stub(gateway.address), greedy_request(PROMPTS[3], 10))
        assert got == _generate(_llm(tiny_llama_dir, 1), SamplingParams(temperature=0.0, max_tokens=10))[3]
        assert metric(decode_worker.metrics, "splitserve_kv_transfer_failures_total", reason="timeout") >= 1
        assert metric(decode_worker.metrics, "splitserve_kv_transfer_recompute_fallbacks_total") == 1
        assert wait_all_free([prefill.address, decode_worker.address])
    finally:
        stop_cluster(children)


def _check_rank_bytes(prefill_metrics: str, decode_metrics: str, prefill_tp: int, decode_tp: int) -> None:
    """Each rank sent (received) the share of the bytes its pieces carry, and no more: rank 0 never
    held another rank's heads."""
    sent = metric(prefill_metrics, "splitserve_kv_transfer_bytes_total", direction="sent")
    assert sent > 0 and sent == metric(decode_metrics, "splitserve_kv_transfer_bytes_total", direction="received")
    plan = handoff_plan(2, prefill_tp, decode_tp)  # the tiny Llama has 2 KV heads
    num_heads = sum(len(p.heads) for p in plan)
    for where, direction, size, rank_of in (
        (prefill_metrics, "sent", prefill_tp, lambda p: p.src_rank),
        (decode_metrics, "received", decode_tp, lambda p: p.dst_rank),
    ):
        for rank in range(size):
            share = sum(len(p.heads) for p in plan if rank_of(p) == rank) / num_heads
            name = "splitserve_kv_transfer_rank_bytes_total"
            assert metric(where, name, direction=direction, rank=str(rank)) == sent * share, (direction, rank)


def _follower_pids(pid: int) -> list[int]:
    """A worker's follower ranks: its engine core's spawned children (or its own, without a core)."""
    children = _spawned(pid)
    return [rank for child in children for rank in _spawned(child)] or children


def _spawned(pid: int) -> list[int]:
    # Not the resource tracker multiprocessing also starts: spawned processes run spawn_main.
    out = subprocess.run(["pgrep", "-P", str(pid), "-f", "spawn_main"], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def test_a_killed_rank_takes_its_worker_down_cleanly(tiny_llama_dir):
    """SIGKILL a follower rank of an idle worker: the worker leaves the gateway and exits 3 (what `up`
    restarts); the other worker of the cluster goes on serving."""
    children = start_cluster(2, engine_argv(tiny_llama_dir), tp_sizes={"unified": 2})
    try:
        gateway, victim, other = children
        (follower,) = _follower_pids(victim.proc.pid)
        os.kill(follower, signal.SIGKILL)
        assert victim.proc.wait(30) == 3
        assert any("tensor-parallel rank" in line for line in victim.log)
        registry = wpb_grpc.RegistryStub(grpc.insecure_channel(gateway.address))
        listed = [w.address for w in registry.ListWorkers(wpb.ListWorkersRequest(), timeout=5).workers]
        assert listed == [other.address]  # it deregistered before exiting
        assert len(tokens(stub(gateway.address), greedy_request(PROMPTS[0], 4))) == 4
        assert _follower_pids(other.proc.pid)  # the survivor's rank is untouched
    finally:
        stop_cluster(children)


def test_a_tensor_parallel_worker_steps_in_its_engine_core(tiny_llama_dir):
    """Two ranks: the core process leads the follower rank; the output equals
    the single-rank engine's, and every block comes back."""
    children = start_cluster(1, engine_argv(tiny_llama_dir), tp_sizes={"unified": 2})
    try:
        gateway, worker = children
        s = stub(gateway.address)
        got = [tokens(s, greedy_request(p, 10)) for p in PROMPTS]
        assert got == _generate(_llm(tiny_llama_dir, 1), SamplingParams(temperature=0.0, max_tokens=10))
        assert wait_all_free([worker.address])
    finally:
        stop_cluster(children)


_SCRIPT = """
import sys
from splitserve.common.sampling_params import SamplingParams
from splitserve.services.engine.config import CacheConfig, EngineConfig
from splitserve.services.engine.llm import LLM

def main():
    cache = CacheConfig(block_size=8, kv_cache_bytes=4 * 1024**2)
    llm = LLM(EngineConfig(model=sys.argv[1], max_model_len=256, cache=cache, tensor_parallel_size=2))
    print(llm.generate([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=4))[0].token_ids)
"""


def _run_script(tmp_path, tiny_llama_dir, body: str) -> subprocess.CompletedProcess:
    script = tmp_path / "script.py"
    script.write_text(_SCRIPT + body)
    run = [sys.executable, str(script), str(tiny_llama_dir)]
    return subprocess.run(run, capture_output=True, text=True, timeout=300, cwd=tmp_path)


def test_a_script_without_a_main_guard_is_told_to_add_one(tmp_path, tiny_llama_dir):
    """Each rank's process imports the script again (multiprocessing's spawn): unguarded, its top level
    would start ranks of its own; the error says what to do instead of 'rank exited (1)'."""
    done = _run_script(tmp_path, tiny_llama_dir, "main()\n")
    assert done.returncode != 0
    assert "MainNotGuarded" in done.stderr and 'if __name__ == "__main__":' in done.stderr, done.stderr[-3000:]


def test_a_tensor_parallel_llm_left_open_ends_the_script_cleanly(tmp_path, tiny_llama_dir):
    """No close(): the ranks stop at exit, and no process of the script aborts on its way out."""
    done = _run_script(tmp_path, tiny_llama_dir, 'if __name__ == "__main__":\n    main()\n')
    assert done.returncode == 0, done.stderr[-3000:]
    assert "terminate called" not in done.stderr and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.stdout.strip().startswith("[")
