"""`splitserve planner` and `splitserve profile`: their arguments and what they run (torch-free to import;
`profile` loads torch when it runs)."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from collections.abc import Mapping

from splitserve.common.roles import Role


def add_planner_args(subparsers) -> None:
    p = subparsers.add_parser(
        "planner", help="size the prefill and decode tiers (or the unified one) of a running system to SLO targets"
    )
    p.add_argument("--url", default="127.0.0.1:50051", help="the gateway HOST:PORT (its worker registry)")
    p.add_argument("--gateway-metrics", required=True, help="the gateway's Prometheus HOST:PORT (`up` prints it)")
    p.add_argument("--control", default="127.0.0.1:50052", help="the launcher control address `up` printed")
    add_policy_args(p)
    p.add_argument("--log", default=None, help="append the decisions here as JSON lines (default: stdout)")
    p.add_argument("--host", default="127.0.0.1", help="where to serve the planner's own /metrics")
    p.add_argument("--metrics-port", type=int, default=0, help="the planner's /metrics port (0: a free one)")
    from splitserve.common.security_args import add_cluster_args

    add_cluster_args(p)
    p.set_defaults(func=run_planner)


def add_policy_args(p: argparse.ArgumentParser, required: bool = True) -> None:
    """The planner's targets, bounds and policy: on `splitserve planner`, on `splitserve up --autoscale`
    (required=False: only --autoscale needs the targets), and, as keys, in an experiment's autoscale table
    (policy_args_from_table)."""
    g = p.add_argument_group("planner policy")
    g.add_argument("--ttft-ms", type=float, required=required, help="p90 time-to-first-token target")
    g.add_argument("--itl-ms", type=float, required=required, help="p90 inter-token latency target")
    g.add_argument("--mode", default="reactive", choices=["predictive", "reactive"])
    g.add_argument("--profile", default=None, help="performance profile JSON (`splitserve profile`); predictive")
    g.add_argument("--colocated", action="store_true", help="plan unified workers instead of prefill and decode")
    g.add_argument("--min-prefill", type=int, default=1)
    g.add_argument("--max-prefill", type=int, default=8)
    g.add_argument("--min-decode", type=int, default=1)
    g.add_argument("--max-decode", type=int, default=8)
    g.add_argument("--min-workers", type=int, default=1, help="unified workers, with --colocated")
    g.add_argument("--max-workers", type=int, default=8, help="unified workers, with --colocated")
    g.add_argument("--budget", type=int, default=16, help="most workers over all tiers")
    g.add_argument("--interval-s", type=float, default=10.0, help="seconds between decisions")
    g.add_argument("--lead-s", type=float, default=30.0, help="predictive: plan this far ahead (a worker's start-up)")
    g.add_argument("--up-intervals", type=int, default=2, help="reactive: intervals over a target before +1")
    g.add_argument("--down-intervals", type=int, default=6, help="intervals well under (wanting fewer) before -1")
    g.add_argument("--low-watermark", type=float, default=0.5, help="reactive: 'well under' = p90 below this x target")
    g.add_argument("--cooldown-s", type=float, default=60.0, help="no scale-down this soon after a tier's change")
    g.add_argument("--up-cooldown-s", type=float, default=30.0, help="reactive: no second +1 this soon")
    g.add_argument("--utilisation", type=float, default=0.8, help="predictive: the busiest a worker is planned to be")
    g.add_argument("--dry-run", action="store_true", help="decide, log and export only (e.g. for KEDA or an HPA)")


def policy_args_from_table(table: Mapping[str, object]) -> argparse.Namespace:
    """The policy options given as a mapping of their flag names with underscores ({"ttft_ms": 800,
    "max_prefill": 3, "dry_run": true}), parsed as the command line would be (the same defaults and checks)."""
    parser = argparse.ArgumentParser(prog="autoscale", allow_abbrev=False, exit_on_error=False, add_help=False)
    add_policy_args(parser, required=False)
    argv: list[str] = []
    for key, value in table.items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):  # a switch: true gives the flag, false leaves it out
            argv += [flag] if value else []
        else:
            argv += [flag, str(value)]
    try:
        a, unknown = parser.parse_known_args(argv)
    except argparse.ArgumentError as e:
        raise ValueError(f"autoscale: {e}") from None
    if unknown:
        known = sorted(vars(a))
        raise ValueError(f"autoscale: unknown option {unknown[0].lstrip('-').replace('-', '_')!r}; known: {known}")
    if a.ttft_ms is None or a.itl_ms is None:
        raise ValueError("autoscale: give the p90 targets ttft_ms and itl_ms")
    return a


def planner_config_from_args(a: argparse.Namespace, colocated: bool | None = None):
    """The PlannerConfig of add_policy_args' options; colocated (None: --colocated) plans a unified tier."""
    from splitserve.services.planner.capacity import Sizing, SloTargets
    from splitserve.services.planner.policy import Bounds, Mode, PlannerConfig, TierBounds

    if a.colocated if colocated is None else colocated:
        tiers = {Role.UNIFIED: TierBounds(a.min_workers, a.max_workers)}
    else:
        tiers = {
            Role.PREFILL: TierBounds(a.min_prefill, a.max_prefill),
            Role.DECODE: TierBounds(a.min_decode, a.max_decode),
        }
    return PlannerConfig(
        targets=SloTargets(a.ttft_ms / 1e3, a.itl_ms / 1e3),
        bounds=Bounds(tiers, a.budget),
        mode=Mode(a.mode),
        sizing=Sizing(utilisation=a.utilisation),
        lead_s=a.lead_s,
        up_intervals=a.up_intervals,
        down_intervals=a.down_intervals,
        low_watermark=a.low_watermark,
        cooldown_s=a.cooldown_s,
        up_cooldown_s=a.up_cooldown_s,
    )


def run_planner(a: argparse.Namespace) -> int:
    from splitserve.common.security_args import cluster_from_args
    from splitserve.common.serving import start_metrics_server
    from splitserve.services.planner.loop import LauncherScaler, PlannerLoop
    from splitserve.services.planner.metrics import PlannerMetrics
    from splitserve.services.planner.policy import make_policy
    from splitserve.services.planner.profile import Profile
    from splitserve.services.planner.reader import ClusterScraper

    config = planner_config_from_args(a)
    policy = make_policy(config, Profile.load(a.profile) if a.profile else None)
    cluster = cluster_from_args(a)
    metrics = PlannerMetrics()
    port = start_metrics_server(metrics.registry, a.host, a.metrics_port)
    scaler = None if a.dry_run else LauncherScaler(a.control, cluster)
    print(f"planner: {config.mode.value}, metrics http://{a.host}:{port}/metrics", file=sys.stderr, flush=True)
    log = open(a.log, "a") if a.log else sys.stdout  # closed below when it is a file
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    loop = PlannerLoop(policy, ClusterScraper(a.url, a.gateway_metrics, cluster).scrape, metrics, log, scaler)
    try:
        loop.run(a.interval_s, stop)
    except KeyboardInterrupt:
        pass
    finally:
        if log is not sys.stdout:
            log.close()
    return 0


def add_profile_args(subparsers) -> None:
    from splitserve.services.engine.arg_utils import add_engine_args

    p = subparsers.add_parser(
        "profile", help="time a worker's prefill and decode steps at a grid of shapes into a performance profile"
    )
    p.add_argument("--out", default="profile.json", help="the profile file to write")
    p.add_argument("--prefill-lens", default="128,512,2048,8192", help="prompt lengths (comma-separated)")
    p.add_argument("--decode-batches", default="1,8,32,64,128", help="decode batch sizes (comma-separated)")
    p.add_argument("--decode-contexts", default="256,1024,4096", help="decode context lengths (comma-separated)")
    p.add_argument("--repeats", type=int, default=5, help="timed forwards per shape (the median counts)")
    add_engine_args(p)
    p.set_defaults(func=run_profile)


def run_profile(a: argparse.Namespace) -> int:
    from splitserve.services.engine.arg_utils import engine_config_from_args
    from splitserve.services.engine.engine import Engine
    from splitserve.services.planner.profiler import ProfileGrid, measure_profile

    def ints(text: str) -> tuple[int, ...]:
        return tuple(int(x) for x in text.split(","))

    grid = ProfileGrid(ints(a.prefill_lens), ints(a.decode_batches), ints(a.decode_contexts), a.repeats)
    engine = Engine(engine_config_from_args(a))
    try:
        profile = measure_profile(engine, grid)
    finally:
        engine.close()
    profile.save(a.out)
    data = profile.to_json()
    print(f"prefill step s = {data['prefill']['seconds']} ({len(profile.prefill_points)} points)")
    print(f"decode step s = {data['decode']['seconds']} ({len(profile.decode_points)} points)")
    print(f"wrote {a.out}")
    return 0
