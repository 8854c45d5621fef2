"""`splitserve up`: a gateway plus N unified workers, or P prefill and D decode workers (xPyD), as
local processes on free ports.

Each child's output is echoed with a [name] prefix (and its last lines kept on Child.log); a child
that does not come up is named with the tail of that log. Ctrl-C / SIGTERM stops workers first
(they drain), then the gateway; the children die with `up` however it ends (its lifeline). While it
runs, `up` serves the Launcher gRPC service on --admin-port, so `splitserve scale` can change the
shape of the system (the supervisor).
"""

from __future__ import annotations

import argparse
import errno
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitserve.common.security import OPEN_CLUSTER, ClusterSecurity
from splitserve.common.serving import free_port
from splitserve.services.launcher.lifeline import parent_lifeline

if TYPE_CHECKING:
    from splitserve.services.launcher.autoscale import UpPlanner

READY_TIMEOUT_S = 180.0  # how long `up` waits for each child to report SERVING (--ready-timeout)
LOG_TAIL_LINES = 20  # of a child that did not come up, shown in the error


class ProcessExited(RuntimeError):
    """The process being waited for exited before it was healthy."""


class ChildNotReady(RuntimeError):
    """A child of `up` exited, or was not healthy in time, while starting; the message has its log's tail."""


class PortTaken(ValueError):
    """A port `up` is to bind (given, or its default) is in use already."""


@dataclass
class Child:
    name: str
    address: str
    metrics: str
    proc: subprocess.Popen = field(repr=False)
    mode: str = "gateway"
    log: deque[str] = field(default_factory=lambda: deque(maxlen=500), repr=False)  # last output lines
    device: str = ""  # the device(s) it was given, if any: "cuda:2", or "cuda:0,cuda:1" for 2 ranks
    http: str = ""  # the gateway's OpenAI HTTP API, HOST:PORT ("" for workers, or with it off)
    internal: str = ""  # the gateway's internal port (Registry over the cluster's mTLS), HOST:PORT, if any
    # Set once address and metrics are known: at once for a gateway; for a worker, which binds port 0 and
    # says where in its ready line, when that line comes (its address is "" until then).
    announced: threading.Event = field(default_factory=threading.Event, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.address:
            self.announced.set()

    @property
    def registry(self) -> str:
        """Where members reach this child: the gateway's internal port if it has one, else its address."""
        return self.internal or self.address


_READY_LINE = re.compile(r"worker ready: grpc (\S+) metrics http://(\S+)/metrics")


class _Announcement:
    """A worker's ready line, read on its output's thread, into its Child: a worker binds port 0 and
    says where, so no port is named (on its command line, which any local user can read) before it is
    bound. The line may come before the Child exists; whichever comes second fills it in."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._child: Child | None = None
        self._where: tuple[str, str] | None = None

    def read(self, line: str) -> None:
        found = _READY_LINE.match(line)
        if found is not None:
            with self._lock:
                self._where = (found[1], found[2])
                self._fill()

    def attach(self, child: Child) -> Child:
        with self._lock:
            self._child = child
            self._fill()
        return child

    def _fill(self) -> None:
        if self._child is not None and self._where is not None and not self._child.announced.is_set():
            self._child.address, self._child.metrics = self._where
            self._child.announced.set()


def _spawn(
    name: str,
    argv: list[str],
    env: dict[str, str],
    log: deque[str] | None = None,
    on_line: Callable[[str], None] | None = None,
    prefix: Sequence[str] = (),
) -> subprocess.Popen:
    """prefix: what runs the command (e.g. `ip netns exec NS`: an emulated host, tests/netns_hosts.py)."""
    lifeline = parent_lifeline()  # the child dies with this process
    proc = subprocess.Popen(
        [*prefix, sys.executable, "-m", "splitserve.services.launcher.cli", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
        env=lifeline.child_env(env),
        pass_fds=(lifeline.read_fd,),
    )

    def echo() -> None:
        assert proc.stdout is not None  # stdout=PIPE
        for line in proc.stdout:
            if log is not None:
                log.append(line.rstrip("\n"))
            if on_line is not None:
                on_line(line)
            sys.stdout.write(f"[{name}] {line}")
            sys.stdout.flush()

    threading.Thread(target=echo, daemon=True).start()
    return proc


def wait_healthy(
    address: str,
    timeout_s: float,
    proc: subprocess.Popen | None = None,
    cluster: ClusterSecurity = OPEN_CLUSTER,
    is_worker: bool = True,
) -> None:
    """Wait until the server at address reports SERVING (over the cluster's TLS, when it has one)."""
    deadline = time.monotonic() + timeout_s
    with cluster.blocking_channel(address, to_worker=is_worker) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise ProcessExited(f"process for {address} exited with code {proc.returncode}")
            try:
                status = stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise TimeoutError(f"{address} was not healthy within {timeout_s:.0f} s")


def wait_ready(
    child: Child, timeout_s: float = READY_TIMEOUT_S, cluster: ClusterSecurity = OPEN_CLUSTER, is_worker: bool = True
) -> None:
    """wait_healthy for a child of `up`; ChildNotReady, naming it with its log's tail, if it exits or
    is not healthy within timeout_s."""
    try:
        deadline = time.monotonic() + timeout_s
        _wait_announced(child, deadline)
        wait_healthy(child.registry, max(0.0, deadline - time.monotonic()), child.proc, cluster, is_worker)
    except ProcessExited:
        why = f"exited with code {child.proc.returncode} while starting"
    except TimeoutError:
        why = f"was not ready within {timeout_s:.0f} s (if it is only slow, give `up` a longer --ready-timeout)"
    else:
        return
    tail = "\n".join(f"  [{child.name}] {line}" for line in list(child.log)[-LOG_TAIL_LINES:]) or "  (no output)"
    where = child.address or "before it said where it listens"
    raise ChildNotReady(f"{child.name} ({where}) {why}; the last lines of its log:\n{tail}")


def _wait_announced(child: Child, deadline: float) -> None:
    """Until the child has said where it listens; ProcessExited or TimeoutError."""
    while not child.announced.wait(0.2):
        if child.proc.poll() is not None:
            raise ProcessExited(f"{child.name} exited with code {child.proc.returncode}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{child.name} did not say where it listens")


def worker_modes(num_workers: int = 0, num_prefill: int = 0, num_decode: int = 0) -> list[tuple[str, str]]:
    """(name, mode) of each worker to start."""
    if (num_prefill > 0) != (num_decode > 0):
        raise ValueError("a disaggregated system needs both tiers: give --prefill and --decode (each >= 1)")
    if num_workers < 0 or num_prefill < 0 or num_decode < 0:
        raise ValueError("worker counts must be >= 0")
    return (
        [(f"worker-{i}", "unified") for i in range(num_workers)]
        + [(f"prefill-{i}", "prefill") for i in range(num_prefill)]
        + [(f"decode-{i}", "decode") for i in range(num_decode)]
    )


def start_cluster(
    num_workers: int,
    engine_argv: list[str],
    host: str = "127.0.0.1",
    gateway_port: int = 0,
    timeout_s: float = READY_TIMEOUT_S,
    num_prefill: int = 0,
    num_decode: int = 0,
    worker_argv: list[str] | None = None,
    env: dict[str, str] | None = None,
    gateway_argv: list[str] | None = None,
    worker_cpus: list[str] | None = None,
    devices: list[str] | None = None,
    cluster: ClusterSecurity = OPEN_CLUSTER,
    http_port: int | None = 0,
    tp_sizes: dict[str, int] | None = None,
    internal_port: int = 0,
) -> list[Child]:
    """Start gateway + workers and wait until all are healthy; the gateway is children[0].

    worker_argv goes to workers only (e.g. --kv-transfer-timeout), gateway_argv to the gateway only (e.g. --router,
    --redis-url); env adds environment variables. worker_cpus pins worker i to the
    cores worker_cpus[i] ("0,1"), with as many torch threads. tp_sizes gives a mode's workers that many
    tensor-parallel ranks each (--tensor-parallel-size). devices spreads workers over accelerators:
    each worker takes as many distinct devices as it has ranks, the least used first (one GPU per
    rank while there are enough; see pick_devices and spawn_worker).
    Workers that share a GPU start one after another, each once the one before is healthy: each sizes
    its KV cache from what it measures on the device while it starts. cluster is how this process
    reaches them (their security flags are in gateway_argv and worker_argv). http_port: the gateway's
    OpenAI HTTP API (0: a free port; None: off); children[0].http is its HOST:PORT. With cluster
    certificates the gateway serves members on an internal port (internal_port; 0: a free one) over mTLS:
    children[0].registry is its HOST:PORT.
    """
    modes = worker_modes(num_workers, num_prefill, num_decode)
    if not modes:
        raise ValueError("start at least one worker (--workers N, or --prefill P --decode D)")
    tp_sizes = tp_sizes or {}
    threads = threads_per_worker(sum(tp_sizes.get(mode, 1) for _, mode in modes))
    used: Counter[str] = Counter()
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    model = _model_argv(engine_argv)
    gw_port, gw_metrics = gateway_port or free_port(host), free_port(host)
    gw_http = None if http_port is None else (http_port or free_port(host))
    argv = ["gateway", "--host", host, "--port", str(gw_port), "--metrics-port", str(gw_metrics)]
    argv += ["--http-port", str(-1 if gw_http is None else gw_http), *model, *(gateway_argv or [])]
    http = "" if gw_http is None else f"{host}:{gw_http}"
    # With cluster certificates, members meet the gateway on a port of their own (mTLS), never the public one.
    internal = f"{host}:{internal_port or free_port(host)}" if cluster.identity is not None else ""
    argv += ["--internal-port", internal.rpartition(":")[2]] if internal else []
    log: deque[str] = deque(maxlen=500)
    proc = _spawn("gateway", argv, env, log)
    gateway = Child("gateway", f"{host}:{gw_port}", f"{host}:{gw_metrics}", proc, log=log, http=http, internal=internal)
    children = [gateway]
    try:
        wait_ready(gateway, timeout_s, cluster, is_worker=False)
        for i, (name, mode) in enumerate(modes):
            pin = ["--cpus", worker_cpus[i]] if worker_cpus else []
            n = len(worker_cpus[i].split(",")) if worker_cpus else threads
            tp = tp_sizes.get(mode, 1)
            device = pick_devices(devices, tp, used) if devices else ""
            wait_for_gpu_peer(children[1:], device, timeout_s, cluster)
            argv = engine_argv + pin + (worker_argv or [])
            children.append(spawn_worker(name, mode, gateway.registry, argv, host, n, env, device, tp))
        for child in children[1:]:
            wait_ready(child, timeout_s, cluster)
        time.sleep(1.5)  # one gateway health-check round, so every worker takes traffic
    except BaseException:
        stop_cluster(children)
        raise
    return children


def wait_for_gpu_peer(
    started: list[Child], device: str, timeout_s: float, cluster: ClusterSecurity = OPEN_CLUSTER
) -> None:
    """Before starting a worker on GPU device(s): wait until the last one started on any of them is healthy."""
    mine = set(device.split(",")) if device.startswith("cuda") else set()
    peers = [c for c in started if mine & set(c.device.split(","))]
    if peers:
        wait_ready(peers[-1], timeout_s, cluster)


def threads_per_worker(num_workers: int) -> int:
    """Torch threads each of num_workers local workers gets: an equal share of the cores."""
    return max(1, (os.cpu_count() or 1) // max(1, num_workers))


def pick_devices(devices: list[str], count: int, used: Counter[str]) -> str:
    """count distinct devices for one worker's ranks, the least used first (ties: list order), as
    "cuda:0,cuda:1"; counts them in used. Workers of one rank each go round robin."""
    if count > len(devices):
        raise ValueError(
            f"a worker with {count} tensor-parallel ranks needs {count} distinct devices; "
            f"--devices lists {len(devices)} ({','.join(devices)})"
        )
    chosen = sorted(sorted(range(len(devices)), key=lambda i: (used[devices[i]], i))[:count])
    used.update(devices[i] for i in chosen)
    return ",".join(devices[i] for i in chosen)


def parse_devices(text: str | None) -> list[str] | None:
    """ "cuda:0,cuda:1" -> the list; "cuda" -> every visible GPU (needs torch); None/"" -> None."""
    if not text:
        return None
    if text == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ValueError("--devices cuda: torch sees no CUDA device")
        return [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    return [d.strip() for d in text.split(",") if d.strip()]


def spawn_worker(
    name: str,
    mode: str,
    gateway: str,
    argv: list[str],
    host: str = "127.0.0.1",
    threads: int = 0,
    env: dict[str, str] | None = None,
    device: str = "",
    tp: int = 1,
) -> Child:
    """Start one worker process with tp tensor-parallel ranks (1: argv decides). device (e.g. "cuda:3",
    or "cuda:0,cuda:1" for 2 ranks; "" keeps argv's --device) binds it for life: see child_device."""
    device_arg, env = child_device(device, env or dict(os.environ, PYTHONUNBUFFERED="1"))
    # --port 0: it binds a free port and says which in its ready line (argv may name one instead)
    full = ["worker", "--mode", mode, "--host", host, "--port", "0", "--metrics-port", "0", "--gateway", gateway]
    full += ["--num-threads", str(threads), *argv]
    full += ["--device", device_arg] if device_arg else []
    full += ["--tensor-parallel-size", str(tp)] if tp > 1 else []
    log: deque[str] = deque(maxlen=500)
    announcement = _Announcement()
    proc = _spawn(name, full, env, log, announcement.read)
    return announcement.attach(Child(name, "", "", proc, mode, log, device))


def child_device(device: str, env: dict[str, str]) -> tuple[str, dict[str, str]]:
    """(--device, environment) of a child given device(s). A child on "cuda:N" (or "cuda:N,cuda:M",
    one per rank) sees only those GPUs (CUDA_VISIBLE_DEVICES, mapped through the parent's own list if
    it has one) and gets --device cuda, its rank r on cuda:r: nothing it runs, in any thread, can touch
    another GPU. Other devices pass through unchanged."""
    parts = [d.strip().partition(":") for d in device.split(",")]
    if any(kind != "cuda" or not index for kind, _, index in parts):
        return device, env
    indices = [int(index) for _, _, index in parts]
    visible = env.get("CUDA_VISIBLE_DEVICES")
    gpu_ids = [d.strip() for d in visible.split(",")] if visible else None  # the parent's cuda:i is gpu_ids[i]
    if gpu_ids is not None and max(indices) >= len(gpu_ids):
        raise ValueError(f"device {device}: CUDA_VISIBLE_DEVICES={visible} lists only {len(gpu_ids)} GPUs")
    ids = [gpu_ids[i] if gpu_ids is not None else str(i) for i in indices]
    return "cuda", dict(env, CUDA_VISIBLE_DEVICES=",".join(ids))


def stop_cluster(children: list[Child], timeout_s: float = 30.0) -> None:
    """Workers first (they drain and deregister), then the gateway."""
    for group in (children[1:], children[:1]):
        for child in group:
            if child.proc.poll() is None:
                child.proc.send_signal(signal.SIGTERM)
        for child in group:
            try:
                child.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                child.proc.kill()
                child.proc.wait()


_PORT_USES = (
    ("the gateway's gRPC API", "give `up` another with --port N"),
    (
        "the gateway's OpenAI HTTP API",
        "give `up` another with --http-port N (0: a free one), or --no-http to serve gRPC only",
    ),
    ("the launcher control of `splitserve scale`", "give `up` another with --admin-port N (0: a free one)"),
    ("the gateway's internal port", "give `up` another with --internal-port N (0: a free one)"),
)


def check_ports_free(host: str, grpc_port: int, http_port: int | None, admin_port: int, internal_port: int = 0) -> None:
    """PortTaken, naming the port and the flag that moves it, if something listens on a port `up`
    would give the gateway or its launcher control (0 or None: a free one is picked, or none)."""
    for port, (use, fix) in zip((grpc_port, http_port, admin_port, internal_port), _PORT_USES):
        if port and not _can_bind(host, port):
            raise PortTaken(f"port {port} on {host} ({use}) is taken: {fix}")


def _can_bind(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        # As the servers bind: a closed connection's TIME_WAIT does not count, only a listener.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                raise
            return False
    return True


def _model_argv(engine_argv: list[str]) -> list[str]:
    if "--model" in engine_argv:
        i = engine_argv.index("--model")
        return engine_argv[i : i + 2]
    return []


def run_up(a: argparse.Namespace, engine_argv: list[str]) -> int:
    """`splitserve up` with its flags a; engine_argv, the rest of its command line, goes to every worker.
    --autoscale runs the SLO planner in this process too (services/launcher/autoscale.py); --ready-timeout
    bounds how long each child may take to come up (at start, and when scaled or restarted); the gateway
    serves members (mTLS) on --internal-port with the cluster certificates of the secrets folder."""
    from splitserve.services.launcher.access import prepare_access
    from splitserve.services.launcher.cli import LIMIT_FLAGS, http_port_from_args
    from splitserve.services.launcher.supervisor import Supervisor, serve_launcher

    num_workers = 0 if (a.prefill or a.decode) and a.workers is None else (a.workers or 1)
    gateway_argv = ["--router", a.router] + (["--redis-url", a.redis_url] if a.redis_url else [])
    gateway_argv += [arg for flag in LIMIT_FLAGS for arg in (flag, str(getattr(a, flag[2:].replace("-", "_"))))]
    traces = ["--otlp-traces-endpoint", a.otlp_traces_endpoint] if a.otlp_traces_endpoint else []
    admin_port, internal_port = a.admin_port or a.port + 1, a.internal_port or a.port + 2
    devices = parse_devices(a.devices)
    access = prepare_access(Path(a.secrets_dir), a.secure, a.host)
    http_port = http_port_from_args(a)
    tp_sizes = {mode: size for mode, size in (("prefill", a.prefill_tp), ("decode", a.decode_tp)) if size}
    planner = _up_planner(a) if a.autoscale else None
    check_ports_free(a.host, a.port, http_port, admin_port, internal_port)  # before starting anything
    engine_argv = engine_argv + traces + access.worker_argv
    children = start_cluster(
        num_workers,
        engine_argv,
        a.host,
        a.port,
        timeout_s=a.ready_timeout,
        num_prefill=a.prefill,
        num_decode=a.decode,
        gateway_argv=gateway_argv + traces + access.gateway_argv,
        devices=devices,
        cluster=access.cluster,
        http_port=http_port,
        tp_sizes=tp_sizes,
        internal_port=internal_port,
    )
    supervisor = Supervisor(
        children,
        engine_argv,
        a.host,
        start_timeout_s=a.ready_timeout,
        devices=devices,
        cluster=access.cluster,
        tp_sizes=tp_sizes,
    )
    admin = serve_launcher(supervisor, a.host, admin_port or free_port(a.host), access.cluster)
    print(
        f"\nsplitserve is up: gateway grpc {children[0].address} "
        f"(metrics http://{children[0].metrics}/metrics); launcher control {supervisor.admin_address}",
        flush=True,
    )
    for child in children[1:]:
        print(f"  {child.name}: grpc {child.address} metrics http://{child.metrics}/metrics", flush=True)
    running = None
    if planner is not None:
        from splitserve.services.launcher.autoscale import RunningPlanner

        running = RunningPlanner.start(planner, supervisor, children[0], access.cluster, a.host)
        print(running.describe(), flush=True)
    operator = " ".join(access.operator_argv)
    if children[0].http:
        print(access.http_hint(children[0].http), flush=True)
    print(
        f"{access.client_hint(children[0].address)}\n"
        f"operator commands:\n"
        f"  splitserve workers --url {children[0].registry} {operator}\n"
        f"  splitserve scale --url {supervisor.admin_address} {operator} --prefill 1 --decode 2\n"
        "Ctrl-C stops everything.",
        flush=True,
    )
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.is_set():
        if children[0].proc.poll() is not None:
            print("gateway exited; stopping workers", flush=True)
            break
        supervisor.restart_crashed()
        stop.wait(0.5)
    if running is not None:
        running.stop()  # first: no decision starts a worker while they stop
    admin.stop(grace=1.0)
    stop_cluster(supervisor.children)
    if running is not None:
        running.close()  # a Scale in flight fails fast now ...
        stop_cluster(supervisor.children)  # ... and any worker it started meanwhile stops too
    return 0


def _up_planner(a: argparse.Namespace) -> UpPlanner:
    """`up --autoscale`: the planner's settings; its tiers are those `up` starts (unified, or prefill and decode)."""
    from splitserve.services.launcher.autoscale import AutoscaleSettings, UpPlanner

    colocated = not (a.prefill or a.decode)
    if a.colocated and not colocated:
        raise ValueError("--colocated plans unified workers: start them with --workers N, not --prefill/--decode")
    log = None if a.planner_log == "-" else Path(a.planner_log or Path(a.secrets_dir) / "planner-decisions.jsonl")
    return UpPlanner(AutoscaleSettings.from_args(a, colocated), log, a.planner_metrics_port)
