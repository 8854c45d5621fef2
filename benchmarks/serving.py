"""Through the gateway (SmolLM2 fp32, CPU), three measurements:

throughput (default): the offline workload of benchmarks/offline.py as concurrent gRPC streams to
    gateway + 1 unified worker, against the in-process engine on the same requests. Target: >= 0.9x.
--prefix-hit: time to the first token through gateway + 1 prefill + 1 decode worker (1P1D), one
    request at a time, of 2,048-token prompts: each of --pairs prefixes of 1,920 tokens is sent twice
    with 128 fresh tokens after it, in a shuffled order; the first time it is cold, the second a prefix
    hit on the prefill worker (the gateway routes it there; the prefix's KV is handed to the decode
    worker again). Two warm-up requests first. Target: cold / hit >= 8x, as in process (offline.py).

--second-token: time to the second token, one request at a time, of unified (one worker) against
    1P1D with the KV streamed layer by layer (the default) and 1P1D sending it after the first token
    (--no-kv-streaming), one pinned core per worker. Target: 1P1D within 1.1x of unified at 4k tokens.

Usage: python benchmarks/serving.py [--quick] [--streams N] [--worker-threads N] [--json PATH]
       python benchmarks/serving.py --second-token [--lengths 256,1024,4096] [--repeats 3] [--json PATH]
       python benchmarks/serving.py --prefix-hit [--pairs 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import time
from urllib.request import urlopen

from prometheus_client.parser import text_string_to_metric_families

from splitserve.common.sampling_params import SamplingParams
from splitserve.experiments.cpu import cpu_seconds
from splitserve.experiments.loadgen import send_workload
from splitserve.experiments.offline import FULL, QUICK
from splitserve.experiments.workload import LengthDist, RequestSpec, WorkloadConfig, make_requests
from splitserve.services.engine.config import CacheConfig, EngineConfig
from splitserve.services.engine.llm import LLM
from splitserve.services.launcher.launcher import start_cluster, stop_cluster, threads_per_worker

KV_CACHE_BYTES = 3 * 1024**3
PREFIX_KV_CACHE_BYTES = 1024**3  # ~23k tokens per worker: every prefix stays cached until its hit
VOCAB_SIZE = 49152
PROMPT_LEN, PREFIX_LEN = 2048, 1920
WARMUP = WorkloadConfig(
    num_requests=1,
    arrival="concurrency",
    prompt_len=LengthDist("fixed", 16),
    output_len=LengthDist("fixed", 4),
    seed=12345,
)


def engine_core_pid(worker_pid: int) -> int:
    """The engine core process a worker spawned."""
    out = subprocess.run(["pgrep", "-P", str(worker_pid), "-f", "spawn_main"], capture_output=True, text=True)
    (pid,) = [int(p) for p in out.stdout.split()]
    return pid


def cpu_used(pids: dict[str, int], fn, *args):
    """(fn(*args), CPU seconds each named process used meanwhile)."""
    before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    result = fn(*args)
    return result, {name: cpu_seconds(pid) - before[name] for name, pid in pids.items()}


STEP_FIELDS = ("num_steps", "seconds", "num_seqs", "num_tokens")
# The worker's counters (splitserve_<name>_total{kind=...}) behind each field.
STEP_SERIES = {
    "engine_steps": "num_steps",
    "engine_step_seconds": "seconds",
    "engine_step_sequences": "num_seqs",
    "engine_step_tokens": "num_tokens",
}


def step_summary(after: dict[str, dict[str, float]], before: dict[str, dict[str, float]]) -> dict:
    """Per step kind, between two snapshots of the step totals: steps, seconds in them, and mean
    sequences and tokens per step."""
    out = {}
    for kind, t in after.items():
        d = {f: t[f] - before.get(kind, {}).get(f, 0) for f in STEP_FIELDS}
        n = max(d["num_steps"], 1)
        out[kind] = {
            "steps": d["num_steps"],
            "seconds": d["seconds"],
            "seqs_per_step": d["num_seqs"] / n,
            "tokens_per_step": d["num_tokens"] / n,
        }
    return out


def worker_steps(metrics_address: str) -> dict[str, dict[str, float]]:
    """The worker's engine step totals by kind, from its /metrics (splitserve_engine_step_*)."""
    with urlopen(f"http://{metrics_address}/metrics", timeout=10) as r:
        text = r.read().decode()
    totals: dict[str, dict[str, float]] = {}
    for family in text_string_to_metric_families(text):
        field = STEP_SERIES.get(family.name.removeprefix("splitserve_"))
        for sample in family.samples if field else ():
            if sample.name == family.name + "_total":
                totals.setdefault(sample.labels["kind"], {})[field] = sample.value
    return totals


def engine_steps(llm: LLM) -> dict[str, dict[str, float]]:
    """The in-process engine's step totals by kind, as worker_steps reads them."""
    snapshot = llm.engine.step_stats.snapshot()
    return {kind.value: {f: getattr(t, f) for f in STEP_FIELDS} for kind, t in snapshot.items()}


def through_gateway(address: str, workload: WorkloadConfig) -> tuple[float, int]:
    """Seconds from the first send to the last stream's end, and output tokens received."""
    records, seconds = send_workload(address, workload, timeout_s=3600)
    return seconds, sum(r.output_tokens for r in records)


def in_process(llm: LLM, requests: list[RequestSpec]) -> tuple[float, int]:
    params = [SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True) for r in requests]
    start = time.perf_counter()
    outs = llm.generate([r.prompt_token_ids for r in requests], params)
    return time.perf_counter() - start, sum(len(o.token_ids) for o in outs)


def throughput(args: argparse.Namespace) -> dict:
    settings = QUICK if args.quick else FULL
    if args.streams:
        settings = dataclasses.replace(settings, num_requests=args.streams)
    workload = settings.workload(VOCAB_SIZE)  # every request sent at once: as many concurrent streams
    requests = make_requests(workload)
    worker_argv = ["--kv-cache-bytes", str(KV_CACHE_BYTES)]
    if args.worker_threads:
        worker_argv += ["--num-threads", str(args.worker_threads)]  # the last --num-threads wins
    children = start_cluster(1, worker_argv)
    try:
        through_gateway(children[0].address, WARMUP)
        pids = {"gateway": children[0].proc.pid, "worker": children[1].proc.pid, "client": os.getpid()}
        pids["engine_core"] = engine_core_pid(children[1].proc.pid)
        before = worker_steps(children[1].metrics)
        (grpc_s, grpc_tokens), cpu = cpu_used(pids, through_gateway, children[0].address, workload)
        grpc_steps = step_summary(worker_steps(children[1].metrics), before)
    finally:
        stop_cluster(children)
    llm = LLM(EngineConfig(cache=CacheConfig(kv_cache_bytes=KV_CACHE_BYTES)))
    llm.generate([requests[0].prompt_token_ids[:16]], SamplingParams(temperature=0, max_tokens=4))  # warm-up
    before = engine_steps(llm)
    (local_s, local_tokens), local_cpu = cpu_used({"in_process": os.getpid()}, in_process, llm, requests)
    local_steps = step_summary(engine_steps(llm), before)
    print(f"\n{len(requests)} requests, {sum(r.max_tokens for r in requests)} output tokens")
    print(f"{'system':<34}{'seconds':>9}{'out tok/s':>11}")
    print(f"{'gateway + 1 worker (gRPC streams)':<34}{grpc_s:>9.2f}{grpc_tokens / grpc_s:>11.1f}")
    print(f"{'in-process LLM.generate':<34}{local_s:>9.2f}{local_tokens / local_s:>11.1f}")
    ratio = (grpc_tokens / grpc_s) / (local_tokens / local_s)
    print(f"ratio gRPC / in-process: {ratio:.2f}x")
    cpu_ms = {name: seconds * 1e3 / grpc_tokens for name, seconds in {**cpu, **local_cpu}.items()}
    print("CPU ms per output token: " + ", ".join(f"{name} {ms:.2f}" for name, ms in cpu_ms.items()))
    for name, steps in (("gRPC worker", grpc_steps), ("in-process", local_steps)):
        print(
            f"{name} steps: "
            + "; ".join(
                f"{kind} {t['steps']:.0f} steps, {t['seconds']:.1f} s, {t['seqs_per_step']:.1f} seqs and "
                f"{t['tokens_per_step']:.1f} tokens per step"
                for kind, t in steps.items()
            )
        )
    return {
        "steps": {"grpc_worker": grpc_steps, "in_process": local_steps},
        "cpu_ms_per_token": cpu_ms,
        "requests": len(requests),
        "grpc": {"seconds": grpc_s, "tokens": grpc_tokens, "tokens_per_s": grpc_tokens / grpc_s},
        "in_process": {"seconds": local_s, "tokens": local_tokens, "tokens_per_s": local_tokens / local_s},
        "ratio_grpc_over_in_process": ratio,
    }


def prefix_workload(pairs: int, seed: int) -> WorkloadConfig:
    """2 x pairs requests, one at a time: every prefix twice (balanced), 128 fresh tokens after it."""
    return WorkloadConfig(
        num_requests=2 * pairs,
        arrival="concurrency",
        concurrency=1,
        prompt_len=LengthDist("fixed", PROMPT_LEN),
        output_len=LengthDist("fixed", 4),
        shared_prefix_fraction=1.0,
        prefix_len=PREFIX_LEN,
        num_prefixes=pairs,
        prefix_assignment="balanced",
        seed=seed,
        vocab_high=VOCAB_SIZE,
    )


def prefix_hit(args: argparse.Namespace) -> dict:
    workload = prefix_workload(args.pairs, seed=0)
    warm_up = prefix_workload(1, seed=1)  # a cold prompt and a hit: every shape once
    argv = ["--kv-cache-bytes", str(PREFIX_KV_CACHE_BYTES)]
    children = start_cluster(0, argv, num_prefill=1, num_decode=1)
    try:
        send_workload(children[0].address, warm_up)
        records, _ = send_workload(children[0].address, workload)
    finally:
        stop_cluster(children)
    seen: set[int | None] = set()
    cold, hit = [], []
    for spec, record in zip(make_requests(workload), records):  # records come in send order
        (hit if spec.prefix_id in seen else cold).append(record.ttft_s)
        seen.add(spec.prefix_id)
    result = {
        "deployment": "1P1D",
        "worker_threads": threads_per_worker(2),
        "prompt_tokens": PROMPT_LEN,
        "cached_tokens": PREFIX_LEN,
        "cold_ttft_s": statistics.median(cold),
        "hit_ttft_s": statistics.median(hit),
        "samples_s": {"cold": cold, "hit": hit},
    }
    result["cold_over_hit"] = result["cold_ttft_s"] / result["hit_ttft_s"]
    print(
        f"\n1P1D through the gateway, {PROMPT_LEN}-token prompts, median of {args.pairs}: TTFT cold "
        f"{result['cold_ttft_s']:.2f} s, {PREFIX_LEN} tokens cached {result['hit_ttft_s']:.3f} s, "
        f"cold / hit {result['cold_over_hit']:.1f}x (target >= 8x)"
    )
    return result


SECOND_TOKEN_KV_BYTES = 512 * 1024**2  # a 4k-token prompt's KV is ~190 MB (SmolLM2 fp32)
SECOND_TOKEN_DEPLOYMENTS = {  # start_cluster arguments: one pinned core per worker
    "unified": {"num_workers": 1, "worker_cpus": ["0"]},
    # the KV streamed layer by layer while the last prompt chunk computes (the default)
    "1P1D": {"num_workers": 0, "num_prefill": 1, "num_decode": 1, "worker_cpus": ["0", "1"]},
    # the KV sent after the first token
    "1P1D after": {
        "num_workers": 0,
        "num_prefill": 1,
        "num_decode": 1,
        "worker_cpus": ["0", "1"],
        "worker_argv": ["--no-kv-streaming"],
    },
}


def one_at_a_time(prompt_len: int, num_requests: int, seed: int) -> WorkloadConfig:
    return WorkloadConfig(
        num_requests=num_requests,
        arrival="concurrency",
        concurrency=1,
        prompt_len=LengthDist("fixed", prompt_len),
        output_len=LengthDist("fixed", 2),
        seed=seed,
        vocab_high=VOCAB_SIZE,
    )


def second_token(args: argparse.Namespace) -> dict:
    lengths = [int(n) for n in args.lengths.split(",")]
    result: dict = {"lengths": lengths, "repeats": args.repeats, "deployments": {}}
    for name, layout in SECOND_TOKEN_DEPLOYMENTS.items():
        children = start_cluster(engine_argv=["--kv-cache-bytes", str(SECOND_TOKEN_KV_BYTES)], **layout)
        try:
            send_workload(children[0].address, one_at_a_time(16, 1, seed=99))  # warm-up
            figures = {}
            for i, n in enumerate(lengths):  # the same seeds in both deployments: the same prompts
                records, _ = send_workload(children[0].address, one_at_a_time(n, args.repeats, seed=i))
                ttst = [r.token_times_s[1] for r in records]  # seconds from the send
                figures[n] = {
                    "ttft_s": statistics.median(r.ttft_s for r in records if r.ttft_s is not None),
                    "second_token_s": statistics.median(ttst),
                    "samples_second_token_s": ttst,
                }
        finally:
            stop_cluster(children)
        result["deployments"][name] = figures
    print(f"\ntime to the second token, one request at a time, median of {args.repeats} (s)")
    print(f"{'prompt':>7}{'deployment':>12}{'TTFT':>9}{'2nd token':>11}{'2nd / unified':>15}")
    unified = result["deployments"]["unified"]
    result["ratio_second_token"] = {}
    for n in lengths:
        for name, figures in result["deployments"].items():
            ratio = figures[n]["second_token_s"] / unified[n]["second_token_s"]
            result["ratio_second_token"].setdefault(name, {})[n] = ratio
            print(f"{n:>7}{name:>12}{figures[n]['ttft_s']:>9.3f}{figures[n]['second_token_s']:>11.3f}{ratio:>14.3f}x")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--streams", type=int, default=0, help="concurrent streams (0: the workload's 64, --quick 8)")
    parser.add_argument("--worker-threads", type=int, default=0, help="torch threads in the worker (0: all cores)")
    parser.add_argument("--prefix-hit", action="store_true", help="cold vs prefix-hit TTFT on 1P1D instead")
    parser.add_argument("--pairs", type=int, default=3, help="--prefix-hit: prefixes, each sent cold then hit")
    parser.add_argument("--second-token", action="store_true", help="time to the 2nd token: 1P1D vs unified")
    parser.add_argument("--lengths", default="256,1024,4096", help="--second-token: prompt lengths")
    parser.add_argument("--repeats", type=int, default=3, help="--second-token: requests per length")
    parser.add_argument("--json", metavar="PATH", help="also write the figures there, as JSON")
    args = parser.parse_args()
    load_before = os.getloadavg()
    if args.second_token:
        result = second_token(args)
    else:
        result = prefix_hit(args) if args.prefix_hit else throughput(args)
    result["conditions"] = {"cpu_count": os.cpu_count(), "load_before": load_before, "load_after": os.getloadavg()}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
