"""Disaggregation benchmarks (CPU, prints numbers).

transfer: KV transfer bandwidth for 1, 16 and 256 blocks of SmolLM2 (fp32, block size 16: 30
    layers x K/V x 16 tokens x 3 KV heads x 64 = 720 KiB per block) between two processes, against
    raw gloo send/recv of the same bytes in the same run. Three rows per size:
      raw gloo       ProcessGroupGloo send/recv of one contiguous tensor (the floor to beat);
      transport      TorchDistSender/TorchDistReceiver (asyncio, pair group, tags);
      handoff path   transport + gather from the paged cache into a reused staging buffer + CRC-32
                     on both sides + scatter into the destination blocks (what a request pays).
    Target: transport >= 0.8x raw gloo.
latency: TTFT, time to the second token and inter-token latency at low load (one request at a time)
    through the gateway: 1 unified worker vs 1P1D, SmolLM2 (bundled), distinct random prompts.
    Both cases give each worker 2 torch threads. Target: 1P1D TTFT <= 1.1x unified.

Usage: python benchmarks/disagg.py transfer [--repeats 5]
       python benchmarks/disagg.py latency [--requests 12 --prompt-len 256 --output-len 32]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from splitserve.disagg.transfer.base import ChannelSpec
from splitserve.disagg.transfer.torch_dist import TorchDistReceiver, TorchDistSender
from splitserve.engine.kv_cache.block_io import checksum, gather_blocks, scatter_blocks
from splitserve.engine.kv_cache.staging import StagingPool
from splitserve.experiments.stats import RequestRecord
from splitserve.experiments.workload import LengthDist, WorkloadConfig

SMOLLM2_KV = (30, 2, 600, 16, 3, 64)  # [layers, K/V, blocks, block_size, kv_heads, head_dim]
SIZES = (1, 16, 256)


def _cache() -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(SMOLLM2_KV)


def _ids(n: int, offset: int) -> list[int]:
    return [(offset + 2 * i) % SMOLLM2_KV[2] for i in range(n)]  # scattered, like a real block table


def _receiver(conn, repeats: int) -> None:
    asyncio.run(_receive_all(conn, repeats))


async def _receive_all(conn, repeats: int) -> None:
    receiver = TorchDistReceiver(timeout_s=120)
    channel = receiver.channel_for("bench")
    conn.send(channel)
    raw = dist.ProcessGroupGloo(dist.PrefixStore("raw", receiver.store), 1, 2, timedelta(seconds=120))
    cache = torch.zeros(SMOLLM2_KV)
    results = {}
    tag = 0
    for n in SIZES:
        buffer = torch.empty(SMOLLM2_KV[:2] + (n,) + SMOLLM2_KV[3:])
        for kind in ("raw gloo", "transport", "handoff path"):
            times = []
            for r in range(repeats):
                tag += 1
                raw.barrier().wait()
                start = time.perf_counter()
                if kind == "raw gloo":
                    raw.recv([buffer], 0, tag).wait()
                else:
                    await receiver.recv(channel, tag, buffer)
                if kind == "handoff path":
                    crc = checksum(buffer)
                    scatter_blocks(cache, _ids(n, r), buffer)
                    assert crc == conn.recv()
                times.append(time.perf_counter() - start)
            results[(n, kind)] = statistics.median(times)
    conn.send(results)
    receiver.close()


async def _send_all(conn, repeats: int) -> None:
    channel: ChannelSpec = conn.recv()
    sender = TorchDistSender(timeout_s=120)
    sender.connect(channel)
    host, port = channel.address.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=120))
    raw = dist.ProcessGroupGloo(dist.PrefixStore("raw", store), 0, 2, timedelta(seconds=120))
    cache = _cache()
    pool = StagingPool(SMOLLM2_KV[:2] + SMOLLM2_KV[3:], cache.dtype)
    tag = 0
    for n in SIZES:
        for kind in ("raw gloo", "transport", "handoff path"):
            for r in range(repeats):
                tag += 1
                prepared = gather_blocks(cache, _ids(n, r)) if kind != "handoff path" else None
                raw.barrier().wait()
                if kind == "raw gloo":
                    raw.send([prepared], 1, tag).wait()
                elif kind == "transport":
                    await sender.send(channel, tag, prepared)
                else:
                    staging = pool.acquire(n)  # as disagg/prefill.py does
                    blocks = gather_blocks(cache, _ids(n, r), out=staging.tensor)
                    sending = asyncio.ensure_future(sender.send(channel, tag, blocks))
                    crc = await asyncio.to_thread(checksum, blocks)
                    await sending
                    pool.release(staging)
                    conn.send(crc)
    sender.close()


def transfer(repeats: int) -> None:
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver, args=(child, repeats))
    proc.start()
    asyncio.run(_send_all(parent, repeats))
    results = parent.recv()
    proc.join()
    block_bytes = 4 * SMOLLM2_KV[0] * SMOLLM2_KV[1] * SMOLLM2_KV[3] * SMOLLM2_KV[4] * SMOLLM2_KV[5]
    print(
        f"\nKV transfer, SmolLM2 fp32 blocks ({block_bytes / 1024:.0f} KiB each), median of {repeats}, "
        f"two processes on {torch.get_num_threads()} threads each"
    )
    print(f"{'blocks':>6} {'MiB':>8} {'path':<14}{'ms':>9}{'GB/s':>8}{'vs raw':>8}")
    for n in SIZES:
        raw = results[(n, "raw gloo")]
        for kind in ("raw gloo", "transport", "handoff path"):
            t = results[(n, kind)]
            print(
                f"{n:>6} {n * block_bytes / 2**20:>8.2f} {kind:<14}{t * 1e3:>9.2f}"
                f"{n * block_bytes / t / 1e9:>8.2f}{raw / t:>7.2f}x"
            )


def latency(num_requests: int, prompt_len: int, output_len: int) -> None:
    from splitserve.experiments.loadgen import send_workload
    from splitserve.launch.launcher import start_cluster, stop_cluster

    # One at a time; the same prompts for both deployments; the first two requests warm up.
    workload = WorkloadConfig(
        num_requests=num_requests + 2,
        arrival="concurrency",
        concurrency=1,
        seed=0,
        prompt_len=LengthDist("fixed", prompt_len),
        output_len=LengthDist("fixed", output_len),
    )
    rows = {}
    shapes = (("unified x1", dict(num_workers=1)), ("1P1D", dict(num_workers=0, num_prefill=1, num_decode=1)))
    for name, shape in shapes:
        children = start_cluster(engine_argv=[], worker_argv=["--num-threads", "2"], **shape)
        try:
            records, _ = send_workload(children[0].address, workload)
            rows[name] = [_latencies(r) for r in records[2:]]
        finally:
            stop_cluster(children)
    print(
        f"\nlow load: {num_requests} sequential requests, prompt {prompt_len} tokens, {output_len} output "
        "tokens, SmolLM2 fp32, 2 torch threads per worker; medians in ms"
    )
    print(f"{'deployment':<12}{'TTFT':>8}{'2nd token':>11}{'ITL':>8}{'E2E':>9}")
    for name, samples in rows.items():
        med = [statistics.median(s[i] for s in samples) * 1e3 for i in range(4)]
        print(f"{name:<12}{med[0]:>8.1f}{med[1]:>11.1f}{med[2]:>8.1f}{med[3]:>9.1f}")
    ratio = statistics.median(s[0] for s in rows["1P1D"]) / statistics.median(s[0] for s in rows["unified x1"])
    print(f"TTFT 1P1D / unified: {ratio:.2f}x (target <= 1.1x)")


def _latencies(r: RequestRecord) -> tuple[float, float, float, float]:
    """(TTFT, time to 2nd token, mean inter-token latency, E2E to the last token) in seconds."""
    times = r.token_times_s
    return times[0], times[1], statistics.mean(r.itls_s), times[-1]


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="what", required=True)
    t = sub.add_parser("transfer")
    t.add_argument("--repeats", type=int, default=9)
    lat = sub.add_parser("latency")
    lat.add_argument("--requests", type=int, default=12)
    lat.add_argument("--prompt-len", type=int, default=256)
    lat.add_argument("--output-len", type=int, default=32)
    args = parser.parse_args()
    if args.what == "transfer":
        transfer(args.repeats)
    else:
        latency(args.requests, args.prompt_len, args.output_len)


if __name__ == "__main__":
    main()
