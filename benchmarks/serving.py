"""Throughput through gateway + 1 unified worker (concurrent gRPC streams) vs the in-process engine,
on the offline workload of benchmarks/offline.py (SmolLM2 fp32, CPU). Target: >= 0.9x.

Usage: python benchmarks/serving.py [--quick]
"""

from __future__ import annotations

import argparse
import time

from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.config import CacheConfig, EngineConfig
from splitserve.engine.llm import LLM
from splitserve.experiments.loadgen import send_workload
from splitserve.experiments.offline import FULL, QUICK
from splitserve.experiments.workload import LengthDist, RequestSpec, WorkloadConfig, make_requests
from splitserve.launch.launcher import start_cluster, stop_cluster

KV_CACHE_BYTES = 3 * 1024**3
VOCAB_SIZE = 49152
WARMUP = WorkloadConfig(
    num_requests=1,
    arrival="concurrency",
    prompt_len=LengthDist("fixed", 16),
    output_len=LengthDist("fixed", 4),
    seed=12345,
)


def through_gateway(address: str, workload: WorkloadConfig) -> tuple[float, int]:
    """Seconds from the first send to the last stream's end, and output tokens received."""
    records, seconds = send_workload(address, workload, timeout_s=3600)
    return seconds, sum(r.output_tokens for r in records)


def in_process(requests: list[RequestSpec]) -> tuple[float, int]:
    llm = LLM(EngineConfig(cache=CacheConfig(kv_cache_bytes=KV_CACHE_BYTES)))
    llm.generate([requests[0].prompt_token_ids[:16]], SamplingParams(temperature=0, max_tokens=4))  # warm-up
    params = [SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True) for r in requests]
    start = time.perf_counter()
    outs = llm.generate([r.prompt_token_ids for r in requests], params)
    return time.perf_counter() - start, sum(len(o.token_ids) for o in outs)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--worker-threads", type=int, default=0, help="torch threads in the worker (0: all cores)")
    args = parser.parse_args()
    workload = (QUICK if args.quick else FULL).workload(VOCAB_SIZE)  # every request sent at once
    requests = make_requests(workload)
    worker_argv = ["--kv-cache-bytes", str(KV_CACHE_BYTES)]
    if args.worker_threads:
        worker_argv += ["--num-threads", str(args.worker_threads)]  # the last --num-threads wins
    children = start_cluster(1, worker_argv)
    try:
        through_gateway(children[0].address, WARMUP)
        grpc_s, grpc_tokens = through_gateway(children[0].address, workload)
    finally:
        stop_cluster(children)
    local_s, local_tokens = in_process(requests)
    print(f"\n{len(requests)} requests, {sum(r.max_tokens for r in requests)} output tokens")
    print(f"{'system':<34}{'seconds':>9}{'out tok/s':>11}")
    print(f"{'gateway + 1 worker (gRPC streams)':<34}{grpc_s:>9.2f}{grpc_tokens / grpc_s:>11.1f}")
    print(f"{'in-process LLM.generate':<34}{local_s:>9.2f}{local_tokens / local_s:>11.1f}")
    print(f"ratio gRPC / in-process: {(grpc_tokens / grpc_s) / (local_tokens / local_s):.2f}x")


if __name__ == "__main__":
    main()
