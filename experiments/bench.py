"""`splitserve bench`: send a workload to a running server (splitserve's gRPC API, or any
OpenAI-compatible HTTP server), print a table, write JSON."""

from __future__ import annotations

import argparse
import asyncio
import ssl
from dataclasses import asdict
from pathlib import Path

from splitserve.common.security import read_secret
from splitserve.experiments.loadgen import (
    API_KEY_ENVS,
    ENDPOINTS,
    Connect,
    OpenAIConfig,
    grpc_connect,
    progress_bar,
    run_connected,
)
from splitserve.experiments.report import format_table, to_json
from splitserve.experiments.stats import SLO, RequestRecord, Summary, summarize
from splitserve.experiments.workload import LengthDist, WorkloadConfig


def add_target_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument(
        "--backend",
        default="grpc",
        choices=["grpc", "openai"],
        help="grpc: a splitserve gateway at --url; openai: any OpenAI-compatible HTTP server at --base-url",
    )
    g.add_argument("--url", default="127.0.0.1:50051", help="grpc: the gateway's HOST:PORT")
    g.add_argument("--base-url", default=None, help="openai: the server's root, e.g. http://127.0.0.1:8000")
    g.add_argument(
        "--endpoint",
        default="completions",
        choices=ENDPOINTS,
        help="openai: /v1/completions (token-id prompts, exact lengths) or /v1/chat/completions (text "
        "prompts of about the length; see docs/experiments.md)",
    )
    g.add_argument("--model", default=None, help="openai: the model to ask for (default: the first /v1/models lists)")
    g.add_argument(
        "--no-ignore-eos",
        action="store_true",
        help="openai: do not send ignore_eos (for servers that reject fields OpenAI lacks; outputs may stop early)",
    )
    g.add_argument("--no-tls-verify", action="store_true", help="openai: do not verify the server's certificate")


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
    connect: Connect, cfg: WorkloadConfig, slo: SLO, show_progress: bool = True
) -> tuple[Summary, list[RequestRecord]]:
    records, seconds = await run_connected(connect, cfg, progress_bar if show_progress else None)
    return summarize(records, seconds, slo), records


def connect_from_args(a: argparse.Namespace) -> tuple[Connect, dict]:
    """The client the flags name, and the settings to record with its report."""
    from splitserve.common.security_args import gateway_credentials_from_args

    if a.backend == "grpc":
        return grpc_connect(a.url, credentials=gateway_credentials_from_args(a)), {"backend": "grpc", "url": a.url}
    if a.base_url is None:
        raise ValueError("--backend openai needs --base-url, e.g. http://127.0.0.1:8000")
    config = OpenAIConfig(
        a.base_url,
        endpoint=a.endpoint,
        model=a.model,
        api_key=read_secret(a.api_key_file, API_KEY_ENVS[0]),
        verify=_tls_verify(a),
        ignore_eos=not a.no_ignore_eos,
    )
    settings = {"backend": "openai", "base_url": a.base_url, "endpoint": a.endpoint, "model": a.model}
    return config.connect, settings | {"ignore_eos": config.ignore_eos}


def _tls_verify(a: argparse.Namespace) -> bool | ssl.SSLContext:
    """--no-tls-verify, or a context with --tls-ca and the client certificate, or the system CAs."""
    if a.no_tls_verify:
        return False
    if a.tls_ca is None and a.tls_client_cert is None:
        return True
    if (a.tls_client_cert is None) != (a.tls_client_key is None):
        raise ValueError("give --tls-client-cert and --tls-client-key together")
    context = ssl.create_default_context(cafile=a.tls_ca)
    if a.tls_client_cert:
        context.load_cert_chain(a.tls_client_cert, a.tls_client_key)
    return context


def run_bench(a: argparse.Namespace) -> int:
    cfg = workload_from_args(a)
    slo = SLO.parse(a.slo)
    connect, settings = connect_from_args(a)
    summary, records = asyncio.run(measure(connect, cfg, slo, show_progress=not a.no_progress))
    print(format_table(summary))
    if a.json:
        Path(a.json).write_text(to_json(summary, records, settings | {"workload": asdict(cfg)}))
        print(f"wrote {a.json}")
    return 0 if summary.num_ok == summary.num_requests else 1
