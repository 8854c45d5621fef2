"""`splitserve bench`: send a workload to a running gateway, print a table, write JSON."""

from __future__ import annotations

import argparse
import asyncio
from dataclasses import asdict
from pathlib import Path

from splitserve.common.security import PLAINTEXT_GATEWAY, GatewayCredentials
from splitserve.experiments.loadgen import progress_bar, run_grpc_load
from splitserve.experiments.report import format_table, to_json
from splitserve.experiments.stats import SLO, RequestRecord, Summary, summarize
from splitserve.experiments.workload import LengthDist, WorkloadConfig


def add_workload_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--num-requests", type=int, default=32)
    g.add_argument("--duration", type=float, default=None, help="seconds to keep sending (poisson/burst)")
    g.add_argument("--arrival", default="poisson", choices=["poisson", "burst", "concurrency"])
    g.add_argument("--rate", type=float, default=4.0, help="requests/s (poisson) or bursts/s (burst)")
    g.add_argument("--burst-size", type=int, default=8)
    g.add_argument("--concurrency", type=int, default=4)
    g.add_argument("--prompt-len", default="128", help="N, uniform:LO:HI or normal:MEAN:STD")
    g.add_argument("--output-len", default="32", help="N, uniform:LO:HI or normal:MEAN:STD")
    g.add_argument("--trace", default=None, help="JSONL of {prompt_len, output_len[, prefix_id]} rows")
    g.add_argument("--shared-prefix-fraction", type=float, default=0.0)
    g.add_argument("--prefix-len", type=int, default=0)
    g.add_argument("--num-prefixes", type=int, default=1)
    g.add_argument(
        "--prefix-assignment",
        default="random",
        choices=["random", "balanced"],
        help="random: each shared request draws its prefix; balanced: equal shares per prefix",
    )
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--vocab-size", type=int, default=49152, help="token ids are drawn below this")


def workload_from_args(a: argparse.Namespace) -> WorkloadConfig:
    return WorkloadConfig(
        num_requests=a.num_requests,
        duration_s=a.duration,
        arrival=a.arrival,
        rate=a.rate,
        burst_size=a.burst_size,
        concurrency=a.concurrency,
        prompt_len=LengthDist.parse(a.prompt_len),
        output_len=LengthDist.parse(a.output_len),
        trace=a.trace,
        shared_prefix_fraction=a.shared_prefix_fraction,
        prefix_len=a.prefix_len,
        num_prefixes=a.num_prefixes,
        prefix_assignment=a.prefix_assignment,
        seed=a.seed,
        vocab_high=a.vocab_size,
    )


async def measure(
    address: str,
    cfg: WorkloadConfig,
    slo: SLO,
    show_progress: bool = True,
    credentials: GatewayCredentials = PLAINTEXT_GATEWAY,
) -> tuple[Summary, list[RequestRecord]]:
    records, seconds = await run_grpc_load(
        address, cfg, progress_bar if show_progress else None, credentials=credentials
    )
    return summarize(records, seconds, slo), records


def run_bench(a: argparse.Namespace) -> int:
    from splitserve.launch.security_args import gateway_credentials_from_args

    cfg = workload_from_args(a)
    slo = SLO.parse(a.slo)
    credentials = gateway_credentials_from_args(a)
    summary, records = asyncio.run(measure(a.url, cfg, slo, show_progress=not a.no_progress, credentials=credentials))
    print(format_table(summary))
    if a.json:
        settings = {"url": a.url, "workload": asdict(cfg)}
        Path(a.json).write_text(to_json(summary, records, settings))
        print(f"wrote {a.json}")
    return 0 if summary.num_ok == summary.num_requests else 1
