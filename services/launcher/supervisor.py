"""The control side of `splitserve up`: the Launcher gRPC service that scales each tier of a
running local system. Starting a worker = spawn, wait until healthy and registered (the gateway
routes to it from its next health check). Removing one = SIGTERM, i.e. the worker's drain: it stops
taking requests, deregisters, finishes (decode, unified) or sends (prefill) what it holds, waits for
KV it holds or awaits to land, exits. The supervisor kills it only past the longest such drain
(common/serving.py drain_bound_s, from the workers' arguments). The least loaded workers of a tier
are removed first (`drain_order`).
"""

from __future__ import annotations

import itertools
import signal
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Sequence
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from splitserve.common.roles import MODES
from splitserve.common.security import OPEN_CLUSTER, BlockingAccessGuard, ClusterSecurity
from splitserve.common.serving import DRAIN_TIMEOUT_S, drain_bound_s
from splitserve.protos.v1 import launcher_pb2 as pb
from splitserve.protos.v1 import launcher_pb2_grpc as pb_grpc
from splitserve.protos.v1 import worker_pb2 as wpb
from splitserve.protos.v1 import worker_pb2_grpc as wpb_grpc
from splitserve.services.launcher.launcher import (
    READY_TIMEOUT_S,
    Child,
    pick_devices,
    spawn_worker,
    threads_per_worker,
    wait_for_gpu_peer,
    wait_ready,
)

RESTART_BACKOFF_S = 10.0  # a worker that crashes again this soon after a restart waits this long
EXIT_GRACE_S = 30.0  # after its drain, a worker stops its server and engine and exits within this
LOAD_TIMEOUT_S = 2.0  # GetLoad of a worker the supervisor may drain


def drain_order(loads: Sequence[wpb.LoadReport | None]) -> list[int]:
    """The order in which to drain a tier's live workers (loads: theirs, oldest worker first; None:
    it did not answer), as indices into loads.

    First the workers that did not answer: most likely dead or hung, nothing to lose, and a drain (or
    the kill after it) clears them. Then those with no KV in flight (no request awaiting KV, no
    prompt's blocks held for a decode worker): their drain waits for no transfer. Then by requests
    running and waiting, fewest first. Ties: the newest first."""

    def key(i: int) -> tuple[int, int, int]:
        load = loads[i]
        if load is None:
            return (0, 0, -i)
        moving_kv = load.num_awaiting_kv > 0 or load.num_held_requests > 0
        return (2 if moving_kv else 1, load.num_running + load.num_waiting, -i)

    return sorted(range(len(loads)), key=key)


def worker_drain_bound_s(worker_argv: Sequence[str]) -> float:
    """The longest drain of a worker started with these arguments (common/serving.py drain_bound_s)."""
    from splitserve.services.launcher.cli import build_parser  # the worker's own flags and defaults

    args, _ = build_parser().parse_known_args(["worker", *worker_argv])
    return drain_bound_s(DRAIN_TIMEOUT_S, args.kv_lease_s, args.kv_transfer_timeout)


class Supervisor:
    """Owns the children of `splitserve up` after start; children[0] is the gateway."""

    def __init__(
        self,
        children: list[Child],
        engine_argv: list[str],
        host: str,
        drain_timeout_s: float | None = None,
        start_timeout_s: float = READY_TIMEOUT_S,
        devices: list[str] | None = None,
        cluster: ClusterSecurity = OPEN_CLUSTER,
        tp_sizes: dict[str, int] | None = None,
    ) -> None:
        self.children = children
        self.cluster = cluster  # how to reach the workers it starts
        self.devices = devices or []  # new workers take the devices the fewest live workers use
        self.tp_sizes = tp_sizes or {}  # mode -> tensor-parallel ranks per worker (default 1)
        self.engine_argv, self.host = engine_argv, host
        # How long a drained worker may take before it is killed; None: longer than its drain can last.
        if drain_timeout_s is None:
            drain_timeout_s = worker_drain_bound_s(engine_argv) + EXIT_GRACE_S
        self.drain_timeout_s, self.start_timeout_s = drain_timeout_s, start_timeout_s
        self.admin_address = ""
        self._lock = threading.Lock()
        self._ids = {mode: itertools.count(sum(c.mode == mode for c in children)) for mode in MODES}
        self._restarted_at: dict[str, float] = {}  # worker name -> when it was last restarted

    def workers(self, mode: str) -> list[Child]:
        return [c for c in self.children[1:] if c.mode == mode and c.proc.poll() is None]

    def shape(self) -> str:
        return ", ".join(f"{len(self.workers(m))} {m}" for m in MODES)

    def scale(self, wanted: dict[str, int]) -> tuple[list[Child], list[Child]]:
        """Start or drain workers until each tier in wanted has that many; returns (started, drained)."""
        with self._lock:
            num_prefill = wanted.get("prefill", len(self.workers("prefill")))
            if num_prefill and not wanted.get("decode", len(self.workers("decode"))):
                raise ValueError("prefill workers need at least one decode worker")
            started, drained = [], []
            for mode, count in wanted.items():
                alive = self.workers(mode)
                if count > len(alive):
                    started += self._start(mode, count - len(alive))
                elif count < len(alive):
                    drained += self._drain(self._victims(alive, len(alive) - count))
            self.children[:] = [self.children[0]] + [c for c in self.children[1:] if c.proc.poll() is None]
            return started, drained

    def _start(self, mode: str, n: int) -> list[Child]:
        tp = self.tp_sizes.get(mode, 1)
        threads = threads_per_worker(self._num_ranks() + n * tp)
        new: list[Child] = []
        for _ in range(n):
            device = pick_devices(self.devices, tp, self._device_use()) if self.devices else ""
            wait_for_gpu_peer(new, device, self.start_timeout_s, self.cluster)  # one at a time per GPU
            new.append(self._spawn(f"{mode}-{next(self._ids[mode])}", mode, threads, device))
            self.children.append(new[-1])
        for child in new:
            wait_ready(child, self.start_timeout_s, self.cluster)
        time.sleep(1.5)  # one gateway health-check round: they take traffic now
        return new

    def restart_crashed(self) -> list[Child]:
        """Start again, same name, mode and device, every worker that exited on its own with an error
        (killed, or its engine loop died: exit 3). Drained workers exit 0 and are not restarted. While a
        Scale runs (minutes) this round is skipped, so `up`'s loop, which calls it, still sees Ctrl-C."""
        if not self._lock.acquire(blocking=False):
            return []
        try:
            return self._restart_crashed()
        finally:
            self._lock.release()

    def _restart_crashed(self) -> list[Child]:
        now, restarted = time.monotonic(), []
        for i, child in enumerate(self.children[1:], start=1):
            code = child.proc.poll()
            since_restart = now - self._restarted_at.get(child.name, -RESTART_BACKOFF_S)
            if code in (None, 0) or since_restart < RESTART_BACKOFF_S:
                continue
            print(f"{child.name} exited with code {code}; starting it again", flush=True)
            self.children[i] = self._spawn(child.name, child.mode, threads_per_worker(self._num_ranks()), child.device)
            self._restarted_at[child.name] = now
            restarted.append(self.children[i])
        return restarted

    def _spawn(self, name: str, mode: str, threads: int, device: str) -> Child:
        """A worker of mode, with the mode's tensor-parallel ranks, that registers with the gateway."""
        tp, gateway = self.tp_sizes.get(mode, 1), self.children[0].registry
        return spawn_worker(name, mode, gateway, self.engine_argv, self.host, threads, device=device, tp=tp)

    def _device_use(self) -> Counter[str]:
        """How many live workers' ranks run on each device."""
        return Counter(d for c in self.children[1:] if c.proc.poll() is None and c.device for d in c.device.split(","))

    def _num_ranks(self) -> int:
        return sum(self.tp_sizes.get(c.mode, 1) for c in self.children[1:])

    def _victims(self, alive: list[Child], n: int) -> list[Child]:
        """The n workers of a tier to drain, by drain_order over their loads as they report them now."""
        order = drain_order([self._load(child) for child in alive])
        return [alive[i] for i in order[:n]]

    def _load(self, child: Child) -> wpb.LoadReport | None:
        if not child.announced.is_set():  # restarted, not listening yet: nothing on it to lose
            return None
        try:
            with self.cluster.blocking_channel(child.address) as channel:
                return wpb_grpc.WorkerStub(channel).GetLoad(wpb.GetLoadRequest(), timeout=LOAD_TIMEOUT_S)
        except grpc.RpcError as e:
            print(f"{child.name} did not report its load ({e.code().name}); draining it first", flush=True)
            return None

    def _drain(self, victims: list[Child]) -> list[Child]:
        for child in victims:
            child.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.drain_timeout_s  # they drain at once: one deadline for all
        for child in victims:
            try:
                child.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                print(f"{child.name} did not exit {self.drain_timeout_s:.0f} s after SIGTERM; killing it", flush=True)
                child.proc.kill()
                child.proc.wait()
        return victims


class LauncherServicer(pb_grpc.LauncherServicer):
    def __init__(self, supervisor: Supervisor) -> None:
        self.supervisor = supervisor

    def Scale(self, request: pb.ScaleRequest, context) -> pb.ScaleResponse:
        wanted = {mode: getattr(request, f"num_{mode}") for mode in MODES if request.HasField(f"num_{mode}")}
        try:
            started, drained = self.supervisor.scale(wanted)
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except (RuntimeError, TimeoutError) as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"a new worker did not come up: {e}")
        return pb.ScaleResponse(
            started=[f"{c.name} {c.address}" for c in started],
            drained=[f"{c.name} {c.address}" for c in drained],
            shape=self.supervisor.shape(),
        )


def serve_launcher(
    supervisor: Supervisor, host: str, port: int, cluster: ClusterSecurity = OPEN_CLUSTER
) -> grpc.Server:
    """The Launcher service on host:port, for members of the cluster only (join secret; with the cluster's
    certificates, mTLS: an operator needs the cluster certificate, as every member does)."""
    launcher_service = pb.DESCRIPTOR.services_by_name["Launcher"].full_name
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=4), interceptors=[BlockingAccessGuard(cluster, (launcher_service,))]
    )
    pb_grpc.add_LauncherServicer_to_server(LauncherServicer(supervisor), server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    credentials = cluster.server_credentials()  # callers show a cluster certificate too (mTLS)
    address = f"{host}:{port}"
    bound = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    server.start()
    supervisor.admin_address = f"{host}:{bound}"
    return server
