"""`splitserve` command line: generate, up, gateway, worker."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from splitserve.common.roles import MODES, Role
from splitserve.common.security_args import (
    add_client_args,
    add_cluster_args,
    cluster_from_args,
    gateway_credentials_from_args,
)
from splitserve.gateway.security_args import add_gateway_security_args, gateway_security_from_args
from splitserve.services.engine.arg_utils import add_engine_args, engine_config_from_args
from splitserve.services.launcher.lifeline import hold_lifeline

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

D = TypeVar("D", bound="DataclassInstance")


def _generate(a: argparse.Namespace) -> int:
    if a.url:
        return _generate_remote(a)
    from splitserve.common.sampling_params import SamplingParams
    from splitserve.services.engine.engine import Engine

    params = SamplingParams(
        temperature=a.temperature,
        top_p=a.top_p,
        top_k=a.top_k,
        max_tokens=a.max_tokens,
        seed=a.sampling_seed,
        stop=a.stop or (),
    )
    engine = Engine(engine_config_from_args(a))
    try:
        if a.cuda_graphs:  # graphs are captured by the warm-up a worker runs before serving
            engine.warm_up()
        _generate_in_process(engine, a, params)
    finally:
        engine.close()  # its tensor-parallel ranks, if any
    return 0


def _generate_in_process(engine, a: argparse.Namespace, params) -> None:
    prompt = engine.tokenizer.encode_chat([{"role": "user", "content": a.prompt}]) if a.chat else a.prompt
    start = time.monotonic()
    engine.add_request(prompt, params)
    last = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            sys.stdout.write(out.new_text)
            sys.stdout.flush()
            last = out
    elapsed = time.monotonic() - start
    if last is not None:
        assert last.finish_reason is not None  # the last output is the one that finished the request
        print(
            f"\n[{last.num_output_tokens} tokens, {last.num_output_tokens / elapsed:.1f} tok/s, "
            f"TTFT {last.timings.ttft_ms or 0:.0f} ms, finish: {last.finish_reason.value}]",
            file=sys.stderr,
        )


def _generate_remote(a: argparse.Namespace) -> int:
    import grpc

    from splitserve.protos.v1 import generation_pb2 as pb
    from splitserve.protos.v1 import generation_pb2_grpc as pb_grpc

    request = pb.GenerateRequest(
        sampling=pb.SamplingParameters(
            temperature=a.temperature, top_p=a.top_p, top_k=a.top_k or 0, seed=a.sampling_seed
        ),
        stopping=pb.StoppingCriteria(max_tokens=a.max_tokens, stop=a.stop or []),
    )
    if a.chat:
        request.chat.messages.add(role="user", content=a.prompt)
    else:
        request.text = a.prompt
    with gateway_credentials_from_args(a).blocking_channel(a.url) as channel:
        try:
            for chunk in pb_grpc.GenerationStub(channel).Generate(request):
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
                if chunk.finish_reason:
                    print(
                        f"\n[{chunk.usage.completion_tokens} tokens, TTFT {chunk.timings.ttft_ms:.0f} ms, "
                        f"E2E {chunk.timings.e2e_ms:.0f} ms, finish: {pb.FinishReason.Name(chunk.finish_reason)}]",
                        file=sys.stderr,
                    )
        except grpc.RpcError as e:
            print(f"\nsplitserve: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    return 0


def _worker(a: argparse.Namespace) -> int:
    import asyncio
    import os

    import torch

    from splitserve.common.tracing import setup_tracing
    from splitserve.services.worker.server import EngineDied, WorkerConfig, serve_worker

    tracing = setup_tracing(a.mode, a.otlp_traces_endpoint)  # logging too: lines name their request and trace
    if a.cpus:
        cores = {int(c) for c in a.cpus.split(",")}
        os.sched_setaffinity(0, cores)  # this worker's cores only (fair colocated vs disaggregated runs)
        torch.set_num_threads(a.num_threads or len(cores))
    elif a.num_threads:
        torch.set_num_threads(a.num_threads)
    config = _from_args(
        WorkerConfig,
        a,
        engine=engine_config_from_args(a),
        kv_transfer_timeout_s=a.kv_transfer_timeout,
        engine_stall_timeout_s=a.engine_stall_timeout,
        cluster=cluster_from_args(a),
    )
    try:
        asyncio.run(serve_worker(config))
    except EngineDied as e:
        print(f"worker: {e}", file=sys.stderr, flush=True)
        return 3  # non-zero: `splitserve up` or the container's restart policy starts a new one
    finally:
        tracing.shutdown()  # sends the spans still buffered
    return 0


def _gateway(a: argparse.Namespace) -> int:
    import asyncio

    from splitserve.common.tracing import setup_tracing
    from splitserve.gateway.generation import MigrationConfig
    from splitserve.gateway.planner import LocalPrefill
    from splitserve.gateway.server import GatewayConfig, serve_gateway
    from splitserve.gateway.validation import RequestLimits

    tracing = setup_tracing("gateway", a.otlp_traces_endpoint)  # logging too: lines name their request and trace
    config = _from_args(
        GatewayConfig,
        a,
        workers=tuple(a.worker or ()),
        forget_unhealthy_after_s=a.forget_unhealthy_after,
        limits=_from_args(RequestLimits, a),
        security=gateway_security_from_args(a),
        http_port=http_port_from_args(a),
        http_cors_origins=tuple(a.http_cors_origin),
        migration=MigrationConfig(a.migration_limit, a.migration_max_tokens),
        local_prefill=LocalPrefill(a.local_prefill_max_tokens, a.local_prefill_queue),
    )
    try:
        with asyncio.Runner(loop_factory=_event_loop_factory()) as runner:
            runner.run(serve_gateway(config))
    finally:
        tracing.shutdown()  # sends the spans still buffered
    return 0


def _from_args(cls: type[D], a: argparse.Namespace, **given: Any) -> D:
    """cls with given, and each other field from the option of the same name where a has one (the rest
    keep cls's defaults; the flags keep their own)."""
    named = {f.name: getattr(a, f.name) for f in fields(cls) if f.name not in given and f.name in vars(a)}
    return cls(**named, **given)


def http_port_from_args(a: argparse.Namespace) -> int | None:
    """The gateway's HTTP port (0: a free one); None: no HTTP API (--no-http, or --http-port -1)."""
    return None if a.no_http or a.http_port < 0 else a.http_port


def _event_loop_factory():
    """uvloop's loop where it is installed (faster sockets for both servers), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def _health(a: argparse.Namespace) -> int:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from splitserve.common.security import GatewayCredentials

    cluster = cluster_from_args(a)
    if a.tls_ca:  # the gateway, verified with its CA
        channel = GatewayCredentials(a.tls_ca).blocking_channel(a.address)
    else:
        channel = cluster.blocking_channel(a.address, to_worker=a.cluster_cert is not None)
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=a.timeout)
        except grpc.RpcError as e:
            print(f"{a.address}: {e.code().name}", file=sys.stderr)
            return 1
    serving = reply.status == health_pb2.HealthCheckResponse.SERVING
    print(f"{a.address}: {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}")
    return 0 if serving else 1


def _workers(a: argparse.Namespace) -> int:
    import grpc

    from splitserve.protos.v1 import worker_pb2 as pb
    from splitserve.protos.v1 import worker_pb2_grpc as pb_grpc

    with cluster_from_args(a).blocking_channel(a.url, to_worker=False) as channel:
        try:
            reply = pb_grpc.RegistryStub(channel).ListWorkers(pb.ListWorkersRequest(), timeout=5)
        except grpc.RpcError as e:
            print(f"splitserve: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    print(
        f"{'id':<5}{'role':<9}{'address':<22}{'healthy':<9}{'in flight':>10}{'running':>9}{'waiting':>9}{'KV used':>9}"
    )
    for w in reply.workers:
        total = w.load.num_total_blocks
        used = f"{1 - w.load.num_free_blocks / total:.0%}" if total else "-"
        role = (Role.from_proto(w.role) or Role.UNIFIED).value
        print(
            f"{w.worker_id:<5}{role:<9}{w.address:<22}{str(w.healthy).lower():<9}{w.outstanding:>10}"
            f"{w.load.num_running:>9}{w.load.num_waiting:>9}{used:>9}"
        )
    return 0


def _scale(a: argparse.Namespace) -> int:
    import grpc

    from splitserve.protos.v1 import launcher_pb2 as pb
    from splitserve.protos.v1 import launcher_pb2_grpc as pb_grpc

    request = pb.ScaleRequest()
    for mode, value in (("unified", a.workers), ("prefill", a.prefill), ("decode", a.decode)):
        if value is not None:
            setattr(request, f"num_{mode}", value)
    with cluster_from_args(a).blocking_channel(a.url, to_worker=False) as channel:
        try:
            reply = pb_grpc.LauncherStub(channel).Scale(request, timeout=600)
        except grpc.RpcError as e:
            print(f"splitserve: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    for line in reply.started:
        print(f"started {line}")
    for line in reply.drained:
        print(f"drained {line}")
    print(f"now: {reply.shape}")
    return 0


def _certs(a: argparse.Namespace) -> int:
    from splitserve.services.launcher.certs import run  # cryptography: not in the gateway image, and only needed here

    return run(a)


def build_parser(*more_commands: Callable[[Any], None]) -> argparse.ArgumentParser:
    """The commands of the processes `up` starts and manages, and the planner's; `splitserve` passes
    the experiments' in more_commands (splitserve/__main__.py)."""
    parser = argparse.ArgumentParser(prog="splitserve", description="Disaggregated LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (add_commands, *more_commands):
        add(sub)
    return parser


def add_commands(sub) -> None:
    gen = sub.add_parser("generate", help="generate text in process and stream it to stdout")
    gen.add_argument("prompt")
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--sampling-seed", type=int, default=None)
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--url", default=None, help="stream from a gateway at HOST:PORT instead of in process")
    add_client_args(gen)
    add_engine_args(gen)
    gen.set_defaults(func=_generate)

    worker = sub.add_parser("worker", help="run one worker (an engine behind the Worker gRPC API)")
    _add_server_args(worker)
    worker.add_argument("--gateway", default=None, help="gateway HOST:PORT to register with")
    worker.add_argument(
        "--advertise-host",
        default=None,
        help="host the gateway and peers reach this worker at (default: --host, or this "
        "machine's IP when --host is 0.0.0.0)",
    )
    worker.add_argument(
        "--mode",
        default=Role.UNIFIED.value,
        choices=MODES,
        help="unified: whole requests; prefill: prompts only, sends KV; decode: continues "
        "requests whose KV a prefill worker sends",
    )
    worker.add_argument(
        "--kv-transfer-timeout",
        type=float,
        default=30.0,
        help="seconds any KV transfer step may take before it counts as failed",
    )
    worker.add_argument(
        "--kv-streaming",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="prefill: send a prompt's KV layer by layer while its last chunk computes (single-rank "
        "workers; --no-kv-streaming: send it after the first token)",
    )
    worker.add_argument(
        "--engine-stall-timeout",
        type=float,
        default=60.0,
        help="seconds the engine core may send nothing while work is queued before the worker gives up on it "
        "(NOT_SERVING, exit 3: `up` or the container restarts it)",
    )
    worker.add_argument(
        "--vllm-metric-names",
        action="store_true",
        help="also export the metrics vLLM has under vLLM's names (vllm:num_requests_running, ...) for tools "
        "built for vLLM (docs/observability.md); `up` passes it to every worker",
    )
    worker.add_argument("--num-threads", type=int, default=0, help="torch threads (0: torch's default)")
    worker.add_argument("--cpus", default=None, help="pin this worker to these cores, e.g. 0,1 (threads = count)")
    add_cluster_args(worker)
    _add_tracing_args(worker)
    add_engine_args(worker)
    worker.set_defaults(func=_worker)

    gateway = sub.add_parser("gateway", help="run the gateway (public Generation API: gRPC and OpenAI HTTP)")
    _add_server_args(gateway)
    gateway.add_argument(
        "--forget-unhealthy-after",
        type=float,
        default=30.0,
        help="seconds a worker may stay unhealthy before the gateway forgets it (it died without "
        "deregistering); a live one registers again",
    )
    gateway.add_argument("--model", default=None, help="the served model (its tokenizer); default: bundled SmolLM2")
    gateway.add_argument("--worker", action="append", help="worker HOST:PORT known at start (repeatable)")
    gateway.add_argument("--max-pending", type=int, default=256)
    gateway.add_argument(
        "--migration-limit",
        type=int,
        default=3,
        help="times one stream may move to another worker when its worker fails mid-stream (0: never; "
        "the stream then ends UNAVAILABLE)",
    )
    gateway.add_argument(
        "--migration-max-tokens",
        type=int,
        default=32768,
        help="the longest stream (prompt + output tokens) the gateway tracks so that it can move; longer "
        "ones end UNAVAILABLE if their worker fails",
    )
    gateway.add_argument(
        "--local-prefill-max-tokens",
        type=int,
        default=0,
        help="a decode worker computes prompts with at most this many tokens it does not hold itself, "
        "without a prefill worker (conditional disaggregation); default 0: off",
    )
    gateway.add_argument(
        "--local-prefill-queue",
        type=int,
        default=0,
        help="a decode worker computes the prompt itself while every prefill worker has at least this many "
        "requests running or queued; default 0: off",
    )
    gateway.add_argument(
        "--router",
        default="kv-aware",
        help="kv-aware (prefix index + load), least-outstanding, round-robin, prefix-affinity",
    )
    gateway.add_argument(
        "--redis-url",
        default=None,
        help="keep the prefix index in Redis (redis://HOST:PORT/DB); default: in gateway memory",
    )
    _add_http_args(gateway, default_port=0)
    gateway.add_argument(
        "--http-cors-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="let browser pages from ORIGIN (e.g. https://app.example) call the HTTP API (CORS); repeatable; "
        "default: none (CORS off)",
    )
    gateway.add_argument(
        "--internal-port",
        type=int,
        default=None,
        help="serve the Registry (workers, operators) on this port instead of the public one, over the cluster's "
        "mTLS only (needs --cluster-ca/--cluster-cert/--cluster-key; 0: a free one; `up` always gives one); the "
        "public API then stays plaintext unless --tls-cert",
    )
    _add_limit_args(gateway)
    add_gateway_security_args(gateway)
    add_cluster_args(gateway)
    _add_tracing_args(gateway)
    gateway.set_defaults(func=_gateway)

    health = sub.add_parser("health", help="exit 0 iff the gRPC server at ADDRESS reports SERVING")
    health.add_argument("address")
    health.add_argument("--timeout", type=float, default=2.0)
    health.add_argument("--tls-ca", default=None, help="the server is a TLS gateway: verify it with this CA")
    add_cluster_args(health)
    health.set_defaults(func=_health)

    workers = sub.add_parser("workers", help="list a gateway's workers: role, address, load, KV usage")
    workers.add_argument("--url", default="127.0.0.1:50051", help="gateway HOST:PORT")
    add_cluster_args(workers)
    workers.set_defaults(func=_workers)

    scale = sub.add_parser("scale", help="change the number of workers per tier of a running `splitserve up`")
    scale.add_argument("--url", default="127.0.0.1:50052", help="the launcher control address `up` printed")
    scale.add_argument("--workers", type=int, default=None, help="unified workers")
    scale.add_argument("--prefill", type=int, default=None)
    scale.add_argument("--decode", type=int, default=None)
    add_cluster_args(scale)
    scale.set_defaults(func=_scale)

    # `splitserve certs`'s flags are here, not beside it, because its module needs cryptography.
    certs = sub.add_parser("certs", help="write a throwaway CA, certificates, an API key and a join secret")
    certs.add_argument("--out", required=True, type=Path, help="folder for the bundle (made 0700)")
    hosts = f"a name or IP clients and workers dial the gateway by (repeatable; default: {' '.join(DEFAULT_HOSTS)})"
    certs.add_argument("--host", action="append", dest="hosts", help=hosts)
    certs.add_argument("--overwrite", action="store_true", help="replace a complete bundle already in --out")
    certs.set_defaults(func=_certs)

    from splitserve.services.planner.cli import add_planner_args, add_policy_args, add_profile_args

    add_planner_args(sub)
    add_profile_args(sub)

    from splitserve.services.launcher.launcher import READY_TIMEOUT_S

    up = sub.add_parser("up", help="start a gateway and its workers as local processes")
    up.add_argument(
        "--workers", type=int, default=None, help="unified workers (default 1, or 0 with --prefill/--decode)"
    )
    up.add_argument("--prefill", type=int, default=0, help="prefill workers (xPyD; needs --decode)")
    up.add_argument("--decode", type=int, default=0, help="decode workers (xPyD; needs --prefill)")
    up.add_argument(
        "--prefill-tp", type=int, default=None, help="tensor-parallel ranks per prefill worker (default: --tp)"
    )
    up.add_argument(
        "--decode-tp", type=int, default=None, help="tensor-parallel ranks per decode worker (default: --tp)"
    )
    up.add_argument(
        "--devices",
        default=None,
        help="spread workers over devices round robin: 'cuda' (every visible GPU, one worker each "
        "in turn) or a list like cuda:0,cuda:1; default: every worker uses --device",
    )
    up.add_argument(
        "--admin-port",
        type=int,
        default=0,
        help="port of the launcher control service for `splitserve scale` (0: gateway port + 1)",
    )
    up.add_argument(
        "--internal-port",
        type=int,
        default=0,
        help="the gateway's port for workers and operators (Registry over the cluster's mTLS; `splitserve workers` "
        "calls it) (0: gateway port + 2)",
    )
    up.add_argument(
        "--ready-timeout",
        type=float,
        default=READY_TIMEOUT_S,
        metavar="S",
        help=f"seconds each process may take to come up (load, warm up, report SERVING), at start and when "
        f"scaled or restarted; past it `up` names the one that is not ready and its last log lines (default "
        f"{READY_TIMEOUT_S:.0f})",
    )
    up.add_argument("--router", default="kv-aware", help="the gateway's router (see `splitserve gateway -h`)")
    up.add_argument("--redis-url", default=None, help="prefix index in Redis; default: in gateway memory")
    _add_limit_args(up)
    up.add_argument("--host", default="127.0.0.1")
    up.add_argument("--port", type=int, default=50051, help="gateway port")
    _add_http_args(up, default_port=8000)
    up.add_argument(
        "--secure",
        action="store_true",
        help="TLS on the public API and an API key as well (default: the public API is plaintext and open; the "
        "internal plane always runs mTLS with a join secret from a throwaway CA made in --secrets-dir)",
    )
    up.add_argument(
        "--secrets-dir",
        default=".splitserve",
        help="where `up` keeps the cluster CA, certificates, join secret (and API key); reused only if it and "
        "its files belong to this user and no one else can change them (keys and secrets: 0600)",
    )
    _add_tracing_args(up)
    _add_autoscale_args(up)
    add_policy_args(up, required=False)
    up.set_defaults(func=None)


def _add_autoscale_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("autoscaling (the SLO planner in this process: docs/planner.md)")
    g.add_argument(
        "--autoscale",
        action="store_true",
        help="size the tiers to --ttft-ms and --itl-ms with the planner's options below (the tiers: prefill and "
        "decode with --prefill/--decode, else unified)",
    )
    g.add_argument(
        "--planner-log",
        default=None,
        help="append the planner's decisions here as JSON lines ('-': stderr; default: "
        "<--secrets-dir>/planner-decisions.jsonl)",
    )
    g.add_argument("--planner-metrics-port", type=int, default=0, help="the planner's /metrics port (0: a free one)")


LIMIT_FLAGS = ("--max-prompt-bytes", "--max-stop-bytes", "--max-stop-total-bytes", "--max-stops")


def _add_limit_args(p: argparse.ArgumentParser) -> None:
    """The gateway's request limits (checked before tokenizing; over one: INVALID_ARGUMENT)."""
    from splitserve.gateway.validation import RequestLimits

    d = RequestLimits()
    g = p.add_argument_group("request limits (gateway)")
    g.add_argument(
        "--max-prompt-bytes",
        type=int,
        default=d.max_prompt_bytes,
        help="largest prompt text, or chat messages, in bytes (also raises gRPC's 4 MiB message limit)",
    )
    g.add_argument("--max-stop-bytes", type=int, default=d.max_stop_bytes, help="largest stop string in bytes")
    g.add_argument(
        "--max-stop-total-bytes",
        type=int,
        default=d.max_stop_total_bytes,
        help="all stop strings of a request together, in bytes",
    )
    g.add_argument(
        "--max-stops", type=int, default=d.max_stops, help="most stop strings, and most stop token ids, per request"
    )


def _add_http_args(p: argparse.ArgumentParser, default_port: int) -> None:
    g = p.add_argument_group("OpenAI-compatible HTTP API (gateway; docs/openai.md)")
    g.add_argument(
        "--http-port",
        type=int,
        default=default_port,
        help=f"port of /v1/completions, /v1/chat/completions, /v1/models, /health, /ready, /metrics ... "
        f"(HTTPS with --tls-cert; 0: a free one, -1: off; default {default_port})",
    )
    g.add_argument("--no-http", action="store_true", help="serve no HTTP API (gRPC only)")


def _add_tracing_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--otlp-traces-endpoint",
        default=None,
        help="send traces (OpenTelemetry) to this OTLP/gRPC collector, e.g. http://localhost:4317; the standard "
        "OTEL_TRACES_EXPORTER=otlp / OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT variables turn them on too (default: off)",
    )


def _add_server_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="gRPC port (0: a free one)")
    p.add_argument("--metrics-port", type=int, default=0, help="Prometheus port (0: a free one)")


DEFAULT_HOSTS = ("localhost", "127.0.0.1")  # the names a `splitserve certs` gateway certificate holds by default


def main(argv: list[str] | None = None, parser: argparse.ArgumentParser | None = None) -> int:
    hold_lifeline()  # started by `up` (or a launcher): die with it
    argv = sys.argv[1:] if argv is None else argv
    args, extra = (parser or build_parser()).parse_known_args(argv)
    try:
        if args.command == "up":  # the rest of the arguments go to every worker
            from splitserve.services.launcher.launcher import run_up

            return run_up(args, extra)
        if extra:
            raise SystemExit(f"splitserve: error: unrecognized arguments: {' '.join(extra)}")
        return args.func(args)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"splitserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
