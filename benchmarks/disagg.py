"""Disaggregation benchmarks (CPU, prints numbers).

transfer: KV transfer bandwidth for 1, 16 and 256 blocks of SmolLM2 (fp32, block size 16: 30
    layers x K/V x 16 tokens x 3 KV heads x 64 = 720 KiB per block) between two processes, against
    raw gloo send/recv of the same bytes in the same run. Three rows per size, interleaved within
    every repeat (so a change in the machine's load hits all three alike):
      raw gloo       ProcessGroupGloo send/recv of one contiguous tensor (the floor to beat);
      transport      TorchDistSender/TorchDistReceiver (asyncio, pair group, tags, chunks, and the
                     XXH3 checksum each side computes while the chunks move);
      handoff path   what a request pays: the sender gathers the blocks from its paged cache into a
                     reused staging buffer chunk by chunk as they are sent, the receiver gets them
                     into a reused buffer and scatters each chunk into the destination blocks as it
                     lands (RankReceivers.recv's drain), then checks its checksum against the
                     sender's (time from the start to the check);
      scatter after  the same, but the scatter of all blocks follows the receive (the handoff path
                     before the scatter overlapped the wire): the difference is what overlapping buys;
      agent path     the handoff path through the KV agents CPU workers run (AgentSender and
                     AgentReceiver: gloo in a child process per side, each chunk copied through a
                     shared-memory segment), what isolating gloo from the worker costs.
    Target: handoff path >= 0.8x raw gloo at 16 and 256 blocks.
latency: TTFT, time to the second token and inter-token latency at low load (one request at a time)
    through the gateway: 1 unified worker vs 1P1D (each worker's engine core runs its KV handoffs),
    SmolLM2 (bundled), distinct random prompts.
    Every case gives each worker 2 torch threads. Target: 1P1D TTFT <= 1.1x unified.

Usage: python benchmarks/disagg.py transfer [--repeats 9] [--json PATH]
       python benchmarks/disagg.py latency [--requests 12 --prompt-len 256 --output-len 32] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from splitserve.experiments.stats import RequestRecord
from splitserve.experiments.workload import LengthDist, WorkloadConfig
from splitserve.services.disagg.transfer.base import ChannelSpec
from splitserve.services.disagg.transfer.isolated import AgentReceiver, AgentSender
from splitserve.services.disagg.transfer.torch_dist import TorchDistReceiver, TorchDistSender
from splitserve.services.engine.kv_cache.block_io import gather_blocks, scatter_blocks
from splitserve.services.engine.kv_cache.staging import Staging, StagingPool

SMOLLM2_KV = (30, 2, 600, 16, 3, 64)  # [layers, K/V, blocks, block_size, kv_heads, head_dim]
SIZES = (1, 16, 256)
KINDS = ("raw", "transport", "handoff path", "scatter after", "agent path")
HANDOFFS = KINDS[2:]  # the kinds that gather on the sender and scatter on the receiver
KEYS = ("raw", "transport", "handoff_path", "scatter_after", "agent_path")  # their names in the JSON
BLOCK_BYTES = 4 * SMOLLM2_KV[0] * SMOLLM2_KV[1] * SMOLLM2_KV[3] * SMOLLM2_KV[4] * SMOLLM2_KV[5]
TIMEOUT = timedelta(seconds=120)


class _Side:
    """One process of the benchmark on one backend: its device, its raw pair group next to the
    transport's channel, and where a handoff's buffers come from."""

    def __init__(self, backend: str, rank: int, store: dist.Store) -> None:
        self.backend, self.rank, self.device = backend, rank, _device(backend, rank)
        self.barrier = dist.ProcessGroupGloo(dist.PrefixStore("barrier", store), rank, 2, TIMEOUT)
        if backend == "gloo":
            self.raw = self.barrier
        else:
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = TIMEOUT
            self.raw = dist.ProcessGroupNCCL(dist.PrefixStore("raw", store), rank, 2, options)
        self.pool = StagingPool(SMOLLM2_KV[:2] + SMOLLM2_KV[3:], torch.float32)

    def buffer(self, n: int) -> Staging:
        """As HandoffPort.acquire_staging: a reused host buffer, or a fresh one on the device."""
        if self.device.type == "cpu":
            return self.pool.acquire(n)
        tensor = torch.empty(SMOLLM2_KV[:2] + (n,) + SMOLLM2_KV[3:], device=self.device)
        return Staging(tensor, tensor, n)

    def release(self, staging: Staging) -> None:
        if self.device.type == "cpu":
            self.pool.release(staging)

    def raw_move(self, tensor: torch.Tensor, tag: int) -> None:
        peer = 1 - self.rank
        work = self.raw.send([tensor], peer, tag) if self.rank == 0 else self.raw.recv([tensor], peer, tag)
        work.wait()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def _device(backend: str, rank: int) -> torch.device:
    return torch.device("cpu") if backend == "gloo" else torch.device("cuda", rank)  # the sender's: cuda:0


def _cache(device: torch.device, fill: bool) -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(SMOLLM2_KV, device=device) if fill else torch.zeros(SMOLLM2_KV, device=device)


def _ids(n: int, offset: int) -> list[int]:
    return [(offset + 2 * i) % SMOLLM2_KV[2] for i in range(n)]  # scattered, like a real block table


def _receiver(conn, repeats: int, backend: str) -> None:
    asyncio.run(_receive_all(conn, repeats, backend))


async def _receive_all(conn, repeats: int, backend: str) -> None:
    receiver = TorchDistReceiver(timeout_s=TIMEOUT.total_seconds(), device=_device(backend, 1))
    channel = receiver.channel_for("bench")  # its backend follows the KV's device
    agent = AgentReceiver(timeout_s=TIMEOUT.total_seconds()) if backend == "gloo" else None
    agent_channel = None if agent is None else agent.channel_for("bench")
    conn.send((channel, agent_channel))
    tag = 0  # one count for both channels, in step with the sender's
    side = _Side(backend, 1, receiver.store)
    cache = _cache(side.device, fill=False)
    times: dict[tuple[int, str], list[float]] = {}
    scatters: dict[tuple[int, str], list[float]] = {}
    cpu: dict[tuple[int, str], list[float]] = {}
    for n in SIZES:
        buffer = torch.empty(SMOLLM2_KV[:2] + (n,) + SMOLLM2_KV[3:], device=side.device)
        for r in range(repeats + 1):  # the first round warms up
            for kind in _kinds(backend):
                tag += 1
                side.barrier.barrier().wait()
                start, start_cpu = time.perf_counter(), _cpu_s(agent)
                if kind == "raw":
                    side.raw_move(buffer, tag)
                elif kind == "transport":
                    await receiver.recv(channel, tag, buffer)
                else:
                    overlap, via = (
                        kind != "scatter after",
                        (receiver, channel) if kind != "agent path" else (agent, agent_channel),
                    )
                    scatter_s = await _land(*via, tag, side, n, cache, _ids(n, r), conn, overlap)
                    scatters.setdefault((n, kind), []).append(scatter_s)
                if r:
                    times.setdefault((n, kind), []).append(time.perf_counter() - start)
                    cpu.setdefault((n, kind), []).append(_cpu_s(agent) - start_cpu)
    sender_cpu = conn.recv()
    medians = [{k: statistics.median(v) for k, v in d.items()} for d in (times, scatters, cpu)]
    conn.send((*medians, sender_cpu))
    receiver.close()
    if agent is not None:
        agent.close()


async def _land(receiver, channel, tag, side: _Side, n, cache, ids, conn, overlap: bool) -> float:
    """The decode side of a handoff: receive into a buffer, scatter (each chunk as it lands, or all
    after), check; the seconds spent scattering (on the receiving thread when overlapped)."""
    staging = side.buffer(n)  # as RankReceivers.recv does
    scattering = [0.0]

    def drain(rows: slice | None) -> None:  # what ModelRunner.row_writer does for a whole rank
        start = time.perf_counter()
        scatter_blocks(cache, ids, staging.tensor, rows)
        if side.device.type == "cuda":
            torch.cuda.synchronize(side.device)
        scattering[0] += time.perf_counter() - start

    moved = await receiver.recv(channel, tag, staging.tensor, drain if overlap else None)
    if not overlap:
        drain(None)
    if moved.checksum != conn.recv():  # the sender's, as TransferDone carries it
        raise SystemExit("checksum mismatch")
    side.release(staging)
    return scattering[0]


async def _send_all(conn, repeats: int, backend: str) -> None:
    channel: ChannelSpec
    channel, agent_channel = conn.recv()
    sender = TorchDistSender(timeout_s=TIMEOUT.total_seconds(), device=_device(backend, 0))
    sender.connect(channel)  # first: the receiver's side of the channel waits for it
    agent = None if agent_channel is None else AgentSender(timeout_s=TIMEOUT.total_seconds())
    if agent is not None:
        agent.connect(agent_channel)
    host, port = channel.address.rsplit(":", 1)
    side = _Side(backend, 0, dist.TCPStore(host, int(port), is_master=False, timeout=TIMEOUT))
    cache, tag = _cache(side.device, fill=True), 0
    cpu: dict[tuple[int, str], list[float]] = {}
    for n in SIZES:
        for r in range(repeats + 1):
            for kind in _kinds(backend):
                tag += 1  # the receiver's count, in step
                prepared = gather_blocks(cache, _ids(n, r)) if kind not in HANDOFFS else None
                side.barrier.barrier().wait()
                start_cpu = _cpu_s(agent)
                if kind == "raw":
                    side.raw_move(prepared, tag)
                elif kind == "transport":
                    await sender.send(channel, tag, prepared)
                else:
                    staging, ids = side.buffer(n), _ids(n, r)  # as send_piece does
                    fill = _filler(cache, ids, staging.tensor)  # HandoffPort.held_reader's whole-heads path
                    via = (sender, channel) if kind != "agent path" else (agent, agent_channel)
                    moved = await via[0].send(via[1], tag, staging.tensor, fill)
                    side.release(staging)
                    conn.send(moved.checksum)
                if r:
                    cpu.setdefault((n, kind), []).append(_cpu_s(agent) - start_cpu)
    conn.send({k: statistics.median(v) for k, v in cpu.items()})
    sender.close()
    if agent is not None:
        agent.close()


def _cpu_s(agent: AgentReceiver | AgentSender | None) -> float:
    """This process's CPU seconds (every thread), plus its KV agent's."""
    seconds = time.process_time()
    pid = None if agent is None else agent.agent.pid()
    if pid is not None:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        seconds += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
    return seconds


def _kinds(backend: str) -> tuple[str, ...]:
    """The agent path moves gloo channels only (a CUDA worker's KV stays in its process)."""
    return KINDS if backend == "gloo" else KINDS[:-1]


def _filler(cache: torch.Tensor, ids: list[int], out: torch.Tensor):
    return lambda rows: gather_blocks(cache, ids, out, rows)


def _sender(conn, repeats: int, backend: str) -> None:
    asyncio.run(_send_all(conn, repeats, backend))


def transfer(repeats: int, json_path: str | None) -> None:
    report: dict = {"conditions": _conditions(repeats)}
    for backend in ("gloo", "nccl"):
        skipped = _skipped(backend)
        if skipped:
            print(f"\n{backend}: not measured ({skipped})")
            report[backend] = {"skipped": skipped}
            continue
        results, scatters, *cpu = _run_pair(repeats, backend)
        rows = [_row(n, results, scatters, cpu) for n in SIZES]
        report[backend] = {"sizes": rows}
        _print_transfer(backend, rows, report["conditions"])
    conditions = report["conditions"]
    conditions["load_after"] = os.getloadavg()
    print(f"load average {conditions['load_before'][0]:.2f} before, {conditions['load_after'][0]:.2f} after")
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=2))


def _skipped(backend: str) -> str | None:
    if backend == "nccl" and not (dist.is_nccl_available() and torch.cuda.device_count() >= 2):
        return f"needs NCCL and two CUDA devices; this machine has {torch.cuda.device_count()}"
    return None


def _run_pair(repeats: int, backend: str) -> tuple[dict, dict, dict, dict]:
    """Receiver (rank 1) and sender (rank 0) in two processes: the medians of the receiver's wall
    time, its scattering, its CPU time and the sender's CPU time (both processes' every thread)."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    procs = [
        ctx.Process(target=_receiver, args=(child, repeats, backend)),
        ctx.Process(target=_sender, args=(parent, repeats, backend)),
    ]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join()
    return parent.recv()  # the receiver's, sent once the sender is done with this end


def _conditions(repeats: int) -> dict:
    return {
        "repeats": repeats,
        "statistic": "median",
        "block_bytes": BLOCK_BYTES,
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "load_before": os.getloadavg(),
    }


def _row(n: int, results: dict, scatters: dict, cpu: list[dict]) -> dict:
    """One size's figures; cpu: the receiver's and the sender's CPU seconds per (size, kind)."""
    num_bytes = n * BLOCK_BYTES
    row: dict = {"blocks": n, "mib": num_bytes / 2**20}
    for kind, key in zip(KINDS, KEYS):
        if (n, kind) not in results:
            continue
        seconds = results[(n, kind)]
        row[f"{key}_ms"], row[f"{key}_gbps"] = seconds * 1e3, num_bytes / seconds / 1e9
        row[f"{key}_cpu_ms"] = sum(side[(n, kind)] for side in cpu) * 1e3
        if kind != "raw":
            row[f"{key}_vs_raw"] = results[(n, "raw")] / seconds
        if kind in HANDOFFS:
            row[f"{key}_scatter_ms"] = scatters[(n, kind)] * 1e3
    return row


def _print_transfer(backend: str, rows: list[dict], conditions: dict) -> None:
    print(
        f"\nKV transfer over {backend}, SmolLM2 fp32 blocks ({BLOCK_BYTES / 1024:.0f} KiB each), median of "
        f"{conditions['repeats']}, two processes on {conditions['torch_threads']} threads each"
    )
    print(f"{'blocks':>6} {'MiB':>8} {'path':<14}{'ms':>9}{'GB/s':>8}{'vs raw':>8}{'CPU ms':>9}  of which scattering")
    for row in rows:
        for kind, key in zip(KINDS, KEYS):
            if f"{key}_ms" not in row:
                continue
            ms, gbps = row[f"{key}_ms"], row[f"{key}_gbps"]
            name = f"raw {backend}" if kind == "raw" else kind
            scatter = f"  {row[f'{key}_scatter_ms']:.2f} ms" if kind in HANDOFFS else ""
            line = f"{row['blocks']:>6} {row['mib']:>8.2f} {name:<14}{ms:>9.2f}{gbps:>8.2f}{row['raw_ms'] / ms:>7.2f}x"
            print(f"{line}{row[f'{key}_cpu_ms']:>9.2f}{scatter}")
    print(
        "CPU ms: both processes' CPU time (every thread; and their KV agents' for the agent path) while the "
        "transfer ran, medians per side, summed"
    )


def latency(num_requests: int, prompt_len: int, output_len: int, json_path: str | None) -> None:
    from splitserve.experiments.loadgen import send_workload
    from splitserve.services.launcher.launcher import start_cluster, stop_cluster

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
    disagg = dict(num_workers=0, num_prefill=1, num_decode=1)
    shapes = (
        ("unified x1", dict(num_workers=1)),
        ("1P1D", disagg),  # both workers' step loops and KV handoffs in engine cores
    )
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
    if json_path:
        medians = {
            name: dict(
                zip(
                    ("ttft_ms", "second_token_ms", "itl_ms", "e2e_ms"),
                    (statistics.median(s[i] for s in samples) * 1e3 for i in range(4)),
                )
            )
            for name, samples in rows.items()
        }
        settings = {"requests": num_requests, "prompt_len": prompt_len, "output_len": output_len, "torch_threads": 2}
        Path(json_path).write_text(
            json.dumps({"settings": settings, "medians": medians, "ttft_ratio": ratio}, indent=2)
        )


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
    for p in (t, lat):
        p.add_argument("--json", metavar="PATH", help="also write the figures there, as JSON")
    args = parser.parse_args()
    if args.what == "transfer":
        transfer(args.repeats, args.json)
    else:
        latency(args.requests, args.prompt_len, args.output_len, args.json)


if __name__ == "__main__":
    main()
