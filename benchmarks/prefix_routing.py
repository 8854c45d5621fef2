"""KV-aware routing vs round robin vs an oracle on a shared-prefix workload (prints numbers).

Workload: G system prompts of L tokens; each request is one of them plus a short unique suffix
(S tokens), in random order, sent with fixed concurrency C to a gateway over W unified workers
(unified workers are routed like the prefill tier). Same workload, same seed, three gateways in
one run:
  kv-aware         the default: prefix index + load (gateway/router.py)
  round-robin      each worker in turn
  oracle           prefix-affinity: each system prompt pinned to one worker, balanced (knows the
                   workload's structure; the best hit rate a router can get here)
Reported: prefix-cache hit rate over prompt tokens (from the workers' metrics) and client-side
TTFT p50/p90. Targets: kv-aware hit rate >= 0.9x the oracle's; TTFT p90 <= 0.3x round robin's.

Usage: python benchmarks/prefix_routing.py [--groups 8 --prefix-len 1024 --suffix-len 16
       --requests 128 --concurrency 4 --workers 4] [--model PATH]   (default model: bundled SmolLM2)
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
from splitserve.launch.launcher import start_cluster, stop_cluster
from splitserve.protos.v1 import generation_pb2 as pb
from splitserve.protos.v1 import generation_pb2_grpc as pb_grpc

ROUTERS = (("kv-aware", "kv-aware"), ("round-robin", "round-robin"), ("oracle", "prefix-affinity"))


def workload(a: argparse.Namespace) -> list[list[int]]:
    rng = random.Random(a.seed)
    systems = [[rng.randrange(20, a.vocab) for _ in range(a.prefix_len)] for _ in range(a.groups)]
    prompts = [systems[i % a.groups] + [rng.randrange(20, a.vocab) for _ in range(a.suffix_len)]
               for i in range(a.requests)]
    rng.shuffle(prompts)
    return prompts


def _metric_sum(address: str, name: str) -> float:
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[-1]) for line in text.splitlines() if line.startswith(name))


def ttft(stub, prompt: list[int], output_len: int) -> float:
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParameters(temperature=0),
                                 stopping=pb.StoppingCriteria(max_tokens=output_len, ignore_eos=True))
    start = time.perf_counter()
    first = None
    for chunk in stub.Generate(request, timeout=3600):
        if first is None and chunk.token_ids:
            first = time.perf_counter() - start
    return first


def run(router: str, prompts: list[list[int]], a: argparse.Namespace) -> dict[str, float]:
    engine_argv = ["--model", a.model] if a.model else []
    children = start_cluster(a.workers, engine_argv, gateway_argv=["--router", router])
    try:
        stub = pb_grpc.GenerationStub(grpc.insecure_channel(children[0].address))
        ttft(stub, [7, 8, 9], 2)  # warm-up (no shared prefix)
        workers = [c.metrics for c in children[1:]]
        queries0 = sum(_metric_sum(w, "splitserve:prefix_cache_queries_total") for w in workers)
        hits0 = sum(_metric_sum(w, "splitserve:prefix_cache_hits_total") for w in workers)
        start = time.perf_counter()
        with ThreadPoolExecutor(a.concurrency) as pool:
            ttfts = list(pool.map(lambda p: ttft(stub, p, a.output_len), prompts))
        elapsed = time.perf_counter() - start
        queries = sum(_metric_sum(w, "splitserve:prefix_cache_queries_total") for w in workers) - queries0
        hits = sum(_metric_sum(w, "splitserve:prefix_cache_hits_total") for w in workers) - hits0
    finally:
        stop_cluster(children)
    q = statistics.quantiles(ttfts, n=10)
    return {"hit_rate": hits / queries, "ttft_p50": statistics.median(ttfts), "ttft_p90": q[8], "seconds": elapsed}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--prefix-len", type=int, default=1024)
    p.add_argument("--suffix-len", type=int, default=16)
    p.add_argument("--output-len", type=int, default=4)
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--model", default=None)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    prompts = workload(a)
    results = {name: run(router, prompts, a) for name, router in ROUTERS}
    print(f"\n{a.requests} requests = {a.groups} system prompts x {a.prefix_len} tokens + {a.suffix_len}-token "
          f"suffixes, {a.output_len} output tokens, concurrency {a.concurrency}, {a.workers} unified workers")
    print(f"{'router':<13}{'hit rate':>9}{'TTFT p50 ms':>13}{'TTFT p90 ms':>13}{'wall s':>8}")
    for name, r in results.items():
        print(f"{name:<13}{r['hit_rate']:>9.3f}{r['ttft_p50'] * 1e3:>13.0f}{r['ttft_p90'] * 1e3:>13.0f}{r['seconds']:>8.1f}")
    kv, rr, oracle = results["kv-aware"], results["round-robin"], results["oracle"]
    print(f"kv-aware hit rate / oracle: {kv['hit_rate'] / oracle['hit_rate']:.2f} (target >= 0.9); "
          f"TTFT p90 kv-aware / round robin: {kv['ttft_p90'] / rr['ttft_p90']:.2f} (target <= 0.3)")


if __name__ == "__main__":
    main()
