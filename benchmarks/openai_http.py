"""The gateway's OpenAI HTTP API against its gRPC API: the same workload through both, on one
cluster (gateway + 1 unified worker, the bundled SmolLM2), in alternating rounds.

  throughput   --concurrency streams at once, --num-requests prompts of --prompt-len token ids,
               --output-len tokens each (ignore_eos): output tokens / seconds of the round
  TTFT         one request at a time (--ttft-requests per round, 32-token prompts, 4 tokens), the
               APIs taking turns: p50 of the time from sending to the first token

Both through the experiments' clients (splitserve.experiments.loadgen): GrpcClient (grpc.aio Generate
streams) and OpenAIClient (httpx streaming POST /v1/completions, token-id prompts, include_usage,
ignore_eos), the one `splitserve bench --backend openai` uses; prompts from the workload generator.
Targets: HTTP throughput >= 0.9x gRPC's; TTFT p50 within 5 ms of gRPC's.

Usage: python benchmarks/openai_http.py [--rounds 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
from dataclasses import replace

from splitserve.experiments.loadgen import GenerationClient, GrpcClient, OpenAIConfig, record_one, run_load
from splitserve.experiments.workload import LengthDist, RequestSpec, WorkloadConfig, make_requests
from splitserve.services.launcher.launcher import start_cluster, stop_cluster

VOCAB_SIZE = 49152
KV_CACHE_BYTES = 1024**3


async def throughput_round(client: GenerationClient, workload: WorkloadConfig) -> float:
    """Output tokens / s of the whole workload (the same prompts every round and API)."""
    records, seconds = await run_load(client, workload)
    tokens = [r.output_tokens for r in records]
    assert all(r.ok for r in records) and all(t == workload.output_len.a for t in tokens), [r.code for r in records]
    return sum(tokens) / seconds


async def ttft_round(clients: dict[str, GenerationClient], specs: dict[str, list[RequestSpec]], results: dict) -> None:
    """One request at a time, the APIs taking turns request by request (each goes first every other one).
    Each API has prompts of its own: the same prompt twice would hit the prefix cache the second time."""
    for i in range(len(specs["grpc"])):
        for api in list(clients)[:: 1 if i % 2 == 0 else -1]:
            record = await record_one(clients[api], specs[api][i])
            assert record.ok and record.ttft_s is not None, record.code
            results[api]["ttft_s"].append(record.ttft_s)


async def compare(grpc_address: str, http_address: str, args: argparse.Namespace) -> dict:
    workload = WorkloadConfig(
        num_requests=args.num_requests,
        arrival="concurrency",
        concurrency=args.concurrency,
        prompt_len=LengthDist("fixed", args.prompt_len),
        output_len=LengthDist("fixed", args.output_len),
        vocab_high=VOCAB_SIZE,
    )
    short = {
        api: [
            replace(spec, max_tokens=4)
            for spec in make_requests(
                replace(
                    workload,
                    num_requests=args.ttft_requests * args.rounds,
                    prompt_len=LengthDist("fixed", 32),
                    seed=seed,
                )
            )
        ]
        for api, seed in (("grpc", 1), ("http", 2))
    }
    http = OpenAIConfig(f"http://{http_address}")
    clients: dict[str, GenerationClient] = {"grpc": GrpcClient(grpc_address), "http": http.connect(workload)}
    results: dict[str, dict[str, list[float]]] = {api: {"tok_s": [], "ttft_s": []} for api in clients}
    warmup = replace(workload, num_requests=args.concurrency, output_len=LengthDist("fixed", 4))
    try:
        for client in clients.values():  # warm-up: connections, the worker's first steps
            await throughput_round(client, warmup)
        for r in range(args.rounds):
            order = list(clients) if r % 2 == 0 else list(reversed(clients))  # neither always goes first
            for api in order:
                results[api]["tok_s"].append(await throughput_round(clients[api], workload))
                print(f"round {r + 1} {api}: {results[api]['tok_s'][-1]:.1f} tok/s", flush=True)
            batch = slice(r * args.ttft_requests, (r + 1) * args.ttft_requests)
            await ttft_round(clients, {api: specs[batch] for api, specs in short.items()}, results)
    finally:
        for client in clients.values():
            await client.close()
    return results


def summary(results: dict) -> dict:
    out = {
        api: {
            "tok_s_total_mean": statistics.mean(r["tok_s"]),
            "tok_s_rounds": r["tok_s"],
            "ttft_p50_ms": statistics.median(r["ttft_s"]) * 1e3,
        }
        for api, r in results.items()
    }
    out["throughput_ratio_http_over_grpc"] = out["http"]["tok_s_total_mean"] / out["grpc"]["tok_s_total_mean"]
    out["ttft_p50_delta_ms"] = out["http"]["ttft_p50_ms"] - out["grpc"]["ttft_p50_ms"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--ttft-requests", type=int, default=10)
    parser.add_argument("--json", default=None, help="write the settings, every round and the summary here")
    args = parser.parse_args()
    children = start_cluster(1, ["--kv-cache-bytes", str(KV_CACHE_BYTES)])
    try:
        results = asyncio.run(compare(children[0].address, children[0].http, args))
    finally:
        stop_cluster(children)
    report = summary(results)
    print(f"\n{'api':<6}{'out tok/s (mean of rounds)':>28}{'TTFT p50 ms':>14}")
    for api in ("grpc", "http"):
        print(f"{api:<6}{report[api]['tok_s_total_mean']:>28.1f}{report[api]['ttft_p50_ms']:>14.1f}")
    print(
        f"HTTP / gRPC throughput: {report['throughput_ratio_http_over_grpc']:.3f}x; "
        f"TTFT p50 HTTP - gRPC: {report['ttft_p50_delta_ms']:+.2f} ms"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"settings": vars(args), "summary": report}, f, indent=2)


if __name__ == "__main__":
    main()
