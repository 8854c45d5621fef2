"""The gateway's OpenAI HTTP API against its gRPC API: the same workload through both, on one
cluster (gateway + 1 unified worker, the bundled SmolLM2), in alternating rounds.

  throughput   --concurrency streams at once, --num-requests prompts of --prompt-len token ids,
               --output-len tokens each (ignore_eos): output tokens / seconds of the round
  TTFT         one request at a time (--ttft-requests per round, 32-token prompts, 4 tokens), the
               APIs taking turns: p50 of the time from sending to the first token

gRPC: grpc.aio Generate streams. HTTP: httpx streaming POST /v1/completions (stream=true, token-id
prompt, include_usage), parsing each event as a light client would (the openai SDK's pydantic
models cost the client more CPU, which on a small machine the workers would feel).
Targets: HTTP throughput >= 0.9x gRPC's; TTFT p50 within 5 ms of gRPC's.

Usage: python benchmarks/openai_http.py [--rounds 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from collections.abc import Awaitable, Callable

import grpc
import httpx

from splitserve.launch.launcher import start_cluster, stop_cluster
from splitserve.protos.v1 import generation_pb2 as pb
from splitserve.protos.v1 import generation_pb2_grpc as pb_grpc

VOCAB_SIZE = 49152
KV_CACHE_BYTES = 1024**3
Send = Callable[[list[int], int], Awaitable[tuple[float, int]]]  # (prompt, max tokens) -> (TTFT s, tokens)


def grpc_sender(stub: pb_grpc.GenerationStub) -> Send:
    async def send(ids: list[int], max_tokens: int) -> tuple[float, int]:
        request = pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=ids),
            sampling=pb.SamplingParameters(temperature=0.0),
            stopping=pb.StoppingCriteria(max_tokens=max_tokens, ignore_eos=True),
        )
        start, ttft, tokens = time.perf_counter(), 0.0, 0
        async for chunk in stub.Generate(request, timeout=600):
            if chunk.token_ids and not tokens:
                ttft = time.perf_counter() - start
            tokens += len(chunk.token_ids)
        return ttft, tokens

    return send


def http_sender(client: httpx.AsyncClient) -> Send:
    async def send(ids: list[int], max_tokens: int) -> tuple[float, int]:
        body = {
            "prompt": ids,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        start, ttft, tokens = time.perf_counter(), 0.0, 0
        async with client.stream("POST", "/v1/completions", json=body) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if event["choices"] and not ttft:
                    ttft = time.perf_counter() - start
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
        return ttft, tokens

    return send


async def throughput_round(send: Send, prompts: list[list[int]], output_len: int, concurrency: int) -> float:
    gate = asyncio.Semaphore(concurrency)

    async def one(ids: list[int]) -> int:
        async with gate:
            return (await send(ids, output_len))[1]

    start = time.perf_counter()
    tokens = await asyncio.gather(*(one(ids) for ids in prompts))
    assert all(t == output_len for t in tokens), tokens
    return sum(tokens) / (time.perf_counter() - start)


async def ttft_round(senders: dict[str, Send], prompts: list[list[int]], results: dict) -> None:
    """One request at a time, the APIs taking turns request by request (each goes first every other one)."""
    for i, ids in enumerate(prompts):
        for api in list(senders)[:: 1 if i % 2 == 0 else -1]:
            results[api]["ttft_s"].append((await senders[api](ids, 4))[0])


async def compare(grpc_address: str, http_address: str, args: argparse.Namespace) -> dict:
    rng = random.Random(0)
    prompts = [[rng.randrange(VOCAB_SIZE) for _ in range(args.prompt_len)] for _ in range(args.num_requests)]
    short = [[rng.randrange(VOCAB_SIZE) for _ in range(32)] for _ in range(args.ttft_requests * args.rounds)]
    channel = grpc.aio.insecure_channel(grpc_address)
    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)
    client = httpx.AsyncClient(base_url=f"http://{http_address}", timeout=600, limits=limits)
    senders = {"grpc": grpc_sender(pb_grpc.GenerationStub(channel)), "http": http_sender(client)}
    results: dict[str, dict[str, list[float]]] = {api: {"tok_s": [], "ttft_s": []} for api in senders}
    try:
        for send in senders.values():  # warm-up: connections, the worker's first steps
            await throughput_round(send, prompts[: args.concurrency], 4, args.concurrency)
        for r in range(args.rounds):
            order = list(senders) if r % 2 == 0 else list(reversed(senders))  # neither always goes first
            for api in order:
                results[api]["tok_s"].append(
                    await throughput_round(senders[api], prompts, args.output_len, args.concurrency)
                )
                print(f"round {r + 1} {api}: {results[api]['tok_s'][-1]:.1f} tok/s", flush=True)
            await ttft_round(senders, short[r * args.ttft_requests : (r + 1) * args.ttft_requests], results)
    finally:
        await client.aclose()
        await channel.close()
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
