"""Throughput through gateway + 1 unified worker (concurrent gRPC streams) vs the in-process engine,
on the offline workload of benchmarks/offline.py (SmolLM2 fp32, CPU). Target: >= 0.9x.

Usage: python benchmarks/serving.py [--quick]
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
from offline import FULL, QUICK, make_workload  # same folder
from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.config import CacheConfig, EngineConfig
from splitserve.engine.llm import LLM
from splitserve.launch.launcher import start_cluster, stop_cluster
from splitserve.protos.v1 import generation_pb2 as pb
from splitserve.protos.v1 import generation_pb2_grpc as pb_grpc

KV_CACHE_BYTES = 3 * 1024**3
VOCAB_SIZE = 49152


def through_gateway(address: str, prompts, output_lens) -> tuple[float, int]:
    stub = pb_grpc.GenerationStub(grpc.insecure_channel(address, options=[("grpc.max_concurrent_streams", 1000)]))

    def one(i: int) -> int:
        req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompts[i]), sampling=pb.SamplingParameters(temperature=0),
                                 stopping=pb.StoppingCriteria(max_tokens=output_lens[i], ignore_eos=True))
        return sum(len(c.token_ids) for c in stub.Generate(req, timeout=3600))

    start = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        tokens = sum(pool.map(one, range(len(prompts))))
    return time.perf_counter() - start, tokens


def in_process(prompts, output_lens) -> tuple[float, int]:
    llm = LLM(EngineConfig(cache=CacheConfig(kv_cache_bytes=KV_CACHE_BYTES)))
    llm.generate([prompts[0][:16]], SamplingParams(temperature=0, max_tokens=4))  # warm-up
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in output_lens]
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    return time.perf_counter() - start, sum(len(o.token_ids) for o in outs)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--worker-threads", type=int, default=0, help="torch threads in the worker (0: all cores)")
    args = parser.parse_args()
    settings = QUICK if args.quick else FULL
    wl = make_workload(settings, VOCAB_SIZE)
    worker_argv = ["--kv-cache-bytes", str(KV_CACHE_BYTES)]
    if args.worker_threads:
        worker_argv += ["--num-threads", str(args.worker_threads)]  # the last --num-threads wins
    children = start_cluster(1, worker_argv)
    try:
        through_gateway(children[0].address, [p[:16] for p in wl.prompts[:1]], [4])  # warm-up
        grpc_s, grpc_tokens = through_gateway(children[0].address, wl.prompts, wl.output_lens)
    finally:
        stop_cluster(children)
    local_s, local_tokens = in_process(wl.prompts, wl.output_lens)
    print(f"\n{len(wl.prompts)} requests, {wl.num_useful_tokens} output tokens")
    print(f"{'system':<34}{'seconds':>9}{'out tok/s':>11}")
    print(f"{'gateway + 1 worker (gRPC streams)':<34}{grpc_s:>9.2f}{grpc_tokens / grpc_s:>11.1f}")
    print(f"{'in-process LLM.generate':<34}{local_s:>9.2f}{local_tokens / local_s:>11.1f}")
    print(f"ratio gRPC / in-process: {(grpc_tokens / grpc_s) / (local_tokens / local_s):.2f}x")


if __name__ == "__main__":
    main()
