"""`splitserve bench` and `splitserve experiment`: their arguments and what they run."""

from __future__ import annotations

import argparse

from splitserve.common.security_args import add_client_args


def add_commands(sub) -> None:
    from splitserve.experiments.bench import add_target_args, add_workload_args

    bench = sub.add_parser(
        "bench", help="send a workload to a gateway or an OpenAI-compatible server; report latency, goodput"
    )
    bench.add_argument("--slo", default="", help="e.g. ttft_ms=500,tpot_ms=50 (goodput counts requests meeting both)")
    bench.add_argument("--json", default=None, help="write the report (summary + every request) here")
    bench.add_argument("--no-progress", action="store_true")
    add_client_args(bench)
    add_target_args(bench)
    add_workload_args(bench)
    bench.set_defaults(func=_bench)

    experiment = sub.add_parser("experiment", help="run deployments x request rates from a TOML config")
    experiment.add_argument("config", help="TOML file (see experiments/configs/)")
    experiment.add_argument("--out", default=None, help="report folder (default: runs/<config name>-<time>)")
    experiment.set_defaults(func=_experiment)


def _bench(a: argparse.Namespace) -> int:
    from splitserve.experiments.bench import run_bench

    return run_bench(a)


def _experiment(a: argparse.Namespace) -> int:
    from splitserve.experiments.experiment import run_experiment_file

    return run_experiment_file(a.config, a.out)
