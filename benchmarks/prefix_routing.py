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
TTFT p50/p90 (interpolated as `splitserve bench` does). Targets: kv-aware hit rate >= 0.9x the
oracle's; TTFT p90 <= 0.3x round robin's.

Usage: python benchmarks/prefix_routing.py [--groups 8 --prefix-len 1024 --suffix-len 16
       --requests 128 --concurrency 4 --workers 4] [--model PATH]   (default model: bundled SmolLM2)
"""

from __future__ import annotations

import argparse
import urllib.request

from splitserve.experiments.loadgen import send_workload
from splitserve.experiments.stats import summarize
from splitserve.experiments.workload import LengthDist, WorkloadConfig
from splitserve.services.launcher.launcher import start_cluster, stop_cluster

ROUTERS = (("kv-aware", "kv-aware"), ("round-robin", "round-robin"), ("oracle", "prefix-affinity"))
HIT_METRICS = ("splitserve_prefix_cache_queries_total", "splitserve_prefix_cache_hits_total")
# Live workers the index purged for missed heartbeats (target 0: heartbeats must not starve under load).
LIVE_PURGES = 'splitserve_gateway_prefix_index_purged_workers_total{live="true"}'


def workload(a: argparse.Namespace) -> WorkloadConfig:
    """Every request one of the system prompts (equal shares, random order) plus a unique suffix."""
    return WorkloadConfig(
        num_requests=a.requests,
        arrival="concurrency",
        concurrency=a.concurrency,
        prompt_len=LengthDist("fixed", a.prefix_len + a.suffix_len),
        output_len=LengthDist("fixed", a.output_len),
        shared_prefix_fraction=1.0,
        prefix_len=a.prefix_len,
        num_prefixes=a.groups,
        prefix_assignment="balanced",
        seed=a.seed,
        vocab_high=a.vocab,
    )


def _metric_sum(address: str, name: str) -> float:
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()
    return sum(float(line.rsplit(" ", 1)[-1]) for line in text.splitlines() if line.startswith(name))


def _hit_counts(workers: list[str]) -> list[float]:
    """(prefix-cache queries, hits) summed over the workers' metrics."""
    return [sum(_metric_sum(w, name) for w in workers) for name in HIT_METRICS]


def run(router: str, cfg: WorkloadConfig, a: argparse.Namespace) -> dict[str, float]:
    engine_argv = ["--model", a.model] if a.model else []
    children = start_cluster(a.workers, engine_argv, gateway_argv=["--router", router])
    warmup = WorkloadConfig(
        num_requests=1,
        arrival="concurrency",
        prompt_len=LengthDist("fixed", 3),
        output_len=LengthDist("fixed", 2),
        seed=a.seed + 999_999,
        vocab_high=a.vocab,
    )
    try:
        send_workload(children[0].address, warmup)  # no shared prefix
        workers = [c.metrics for c in children[1:]]
        before = _hit_counts(workers)
        records, elapsed = send_workload(children[0].address, cfg, timeout_s=3600)
        queries, hits = (after - b for after, b in zip(_hit_counts(workers), before))
        live_purges = _metric_sum(children[0].metrics, LIVE_PURGES)
    finally:
        stop_cluster(children)
    ttft = summarize(records, elapsed).ttft_ms
    return {
        "hit_rate": hits / queries,
        "ttft_p50": ttft["p50"] / 1e3,
        "ttft_p90": ttft["p90"] / 1e3,
        "seconds": elapsed,
        "live_purges": live_purges,
    }


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
    cfg = workload(a)
    results = {name: run(router, cfg, a) for name, router in ROUTERS}
    print(
        f"\n{a.requests} requests = {a.groups} system prompts x {a.prefix_len} tokens + {a.suffix_len}-token "
        f"suffixes, {a.output_len} output tokens, concurrency {a.concurrency}, {a.workers} unified workers"
    )
    print(f"{'router':<13}{'hit rate':>9}{'TTFT p50 ms':>13}{'TTFT p90 ms':>13}{'wall s':>8}{'live purges':>13}")
    for name, r in results.items():
        print(
            f"{name:<13}{r['hit_rate']:>9.3f}{r['ttft_p50'] * 1e3:>13.0f}{r['ttft_p90'] * 1e3:>13.0f}"
            f"{r['seconds']:>8.1f}{r['live_purges']:>13.0f}"
        )
    kv, rr, oracle = results["kv-aware"], results["round-robin"], results["oracle"]
    print(
        f"kv-aware hit rate / oracle: {kv['hit_rate'] / oracle['hit_rate']:.2f} (target >= 0.9); "
        f"TTFT p90 kv-aware / round robin: {kv['ttft_p90'] / rr['ttft_p90']:.2f} (target <= 0.3)"
    )


if __name__ == "__main__":
    main()
