"""Helpers for tests that talk to real gateway/worker processes over gRPC."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import shutil
import signal
import subprocess
import threading
import time
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitserve.protos.v1 import generation_pb2 as pb
from splitserve.protos.v1 import generation_pb2_grpc as pb_grpc
from splitserve.protos.v1 import worker_pb2 as wpb
from splitserve.protos.v1 import worker_pb2_grpc as wpb_grpc
from splitserve.services.launcher.launcher import (
    Child,
    spawn_worker,
    start_cluster,
    stop_cluster,
    threads_per_worker,
)
from splitserve.services.worker.server import SEND_DELAY_ENV

KV_BYTES = 4 * 1024**2


def secrets_bundle(folder, api_keys: str):
    """A throwaway CA, certificates and join secret in folder (services/launcher/certs.py), plus `test-keys`:
    the API keys file the test's gateway is given instead of the bundle's."""
    from splitserve.services.launcher.certs import make_bundle

    bundle = make_bundle(folder, ("localhost", "127.0.0.1"))
    (folder / "test-keys").write_text(api_keys)
    return bundle


def engine_argv(folder) -> list[str]:
    return ["--model", str(folder), "--kv-cache-bytes", str(KV_BYTES), "--block-size", "8", "--max-model-len", "256"]


def stub(address: str) -> pb_grpc.GenerationStub:
    return pb_grpc.GenerationStub(grpc.insecure_channel(address))


def greedy_request(ids: list[int], max_tokens: int, **sampling) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=ids),
        sampling=pb.SamplingParameters(**{"temperature": 0.0, **sampling}),
        stopping=pb.StoppingCriteria(max_tokens=max_tokens),
    )


def collect(stub_, request, timeout=60.0) -> list[pb.GenerateResponse]:
    return list(stub_.Generate(request, timeout=timeout))


def tokens(stub_, request, timeout=60.0) -> list[int]:
    return [t for chunk in collect(stub_, request, timeout) for t in chunk.token_ids]


def load(worker_address: str) -> wpb.LoadReport:
    return wpb_grpc.WorkerStub(grpc.insecure_channel(worker_address)).GetLoad(wpb.GetLoadRequest(), timeout=5)


def all_blocks_free(worker_address: str) -> bool:
    r = load(worker_address)
    return (
        r.num_free_blocks == r.num_total_blocks and r.num_running == 0 and r.num_waiting == 0 and r.num_awaiting_kv == 0
    )


def wait_all_free(addresses: list[str], timeout_s: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(all_blocks_free(a) for a in addresses):
            return True
        time.sleep(0.1)
    return all(all_blocks_free(a) for a in addresses)


def metric(metrics_address: str, name: str, **labels: str) -> float:
    """Sum of a Prometheus series' samples whose labels include the given ones."""
    text = urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=5).read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[-1])
    return total


def slow_sender_cluster(folder, num_decode: int) -> list[Child]:
    """1P(num_decode)D whose prefill worker waits 3 s before each send, with 1.5 s transfer timeouts: a
    stream's first token is out while its decode worker still waits for the KV (a fault lands then)."""
    return start_cluster(
        0,
        engine_argv(folder),
        num_prefill=1,
        num_decode=num_decode,
        worker_argv=["--kv-transfer-timeout", "1.5"],
        env={SEND_DELAY_ENV: "3"},
    )


def engine_config(folder):
    """The in-process EngineConfig equal to engine_argv(folder) (a reference run's settings)."""
    from splitserve.services.engine.config import CacheConfig, EngineConfig

    return EngineConfig(model=str(folder), max_model_len=256, cache=CacheConfig(block_size=8, kv_cache_bytes=KV_BYTES))


def load_is_idle(r: wpb.LoadReport) -> bool:
    """All KV blocks free and nothing running, waiting, awaiting KV or held for a transfer."""
    return (
        r.num_free_blocks == r.num_total_blocks
        and r.num_running == 0
        and r.num_waiting == 0
        and r.num_awaiting_kv == 0
        and r.num_held_blocks == 0
        and r.num_held_requests == 0
    )


class Cluster:
    """Gateway + P prefill + D decode workers (+ a redis-server for the prefix index when redis) on
    the tiny model; kills workers with SIGKILL and restarts them by name, knows who is ready."""

    def __init__(
        self,
        model,
        num_prefill: int = 2,
        num_decode: int = 2,
        redis: bool = False,
        worker_argv: list[str] | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        from redis_helpers import RedisServer

        self.model, self.worker_argv, self.env = str(model), worker_argv or [], env or {}
        self.redis = RedisServer().start() if redis else None
        try:
            children = start_cluster(
                0,
                engine_argv(self.model),
                num_prefill=num_prefill,
                num_decode=num_decode,
                worker_argv=self.worker_argv,
                env=self.env,
                gateway_argv=["--redis-url", self.redis.url] if self.redis else [],
            )
        except BaseException:
            if self.redis:
                self.redis.stop()
            raise
        self.gateway, self.gateway_pid = children[0], children[0].proc.pid
        self.workers = {c.name: c for c in children[1:]}  # the live instance under each name
        self.ready = set(self.workers)
        self.killed: set[int] = set()  # pids killed here on purpose
        self.lock = threading.Lock()
        self._registry_channel = grpc.insecure_channel(self.gateway.address)
        self.registry = wpb_grpc.RegistryStub(self._registry_channel)
        self._load_channels: dict[str, grpc.Channel] = {}
        self._threads = threads_per_worker(num_prefill + num_decode)

    def ready_workers(self, mode: str) -> list[Child]:
        with self.lock:
            return [c for name, c in self.workers.items() if c.mode == mode and name in self.ready]

    def load(self, address: str) -> wpb.LoadReport:
        if address not in self._load_channels:
            self._load_channels[address] = grpc.insecure_channel(address)
        return wpb_grpc.WorkerStub(self._load_channels[address]).GetLoad(wpb.GetLoadRequest(), timeout=5)

    def kill(self, child: Child) -> None:
        with self.lock:
            self.ready.discard(child.name)
            self.killed.add(child.proc.pid)
        child.proc.send_signal(signal.SIGKILL)
        child.proc.wait()
        channel = self._load_channels.pop(child.address, None)  # one that met a dead port backs off for seconds
        if channel is not None:
            channel.close()

    def unexpected_exits(self) -> list[Child]:
        """Live-listed workers whose process ended without being killed here; taken out of ready."""
        with self.lock:
            dead = [
                c
                for name, c in self.workers.items()
                if name in self.ready and c.proc.poll() is not None and c.proc.pid not in self.killed
            ]
            self.ready.difference_update(c.name for c in dead)
        return dead

    def restart(self, old: Child, same_address: bool) -> Child:
        """The same role again; on old's ports when same_address. Returns once the gateway lists it."""
        argv = engine_argv(self.model) + self.worker_argv
        if same_address:  # the worker's argparse keeps the last --port: the new process takes old's ports
            argv += ["--port", old.address.rsplit(":", 1)[1], "--metrics-port", old.metrics.rsplit(":", 1)[1]]
        new = spawn_worker(
            old.name,
            old.mode,
            self.gateway.address,
            argv,
            threads=self._threads,
            env=dict(os.environ, PYTHONUNBUFFERED="1", **self.env),
        )
        if same_address:
            new = dataclasses.replace(new, address=old.address, metrics=old.metrics)
        elif not new.announced.wait(120):  # it binds free ports and says which once it serves
            raise TimeoutError(f"{new.name} did not say where it listens within 120 s")
        with self.lock:
            self.workers[old.name] = new
        wait_serving(new.address, new.proc, 120)
        self.wait_listed([new.address], 60)
        with self.lock:
            self.ready.add(new.name)
        return new

    def listed(self) -> dict[str, wpb.WorkerInfo]:
        return {w.address: w for w in self.registry.ListWorkers(wpb.ListWorkersRequest(), timeout=5).workers}

    def wait_listed(self, addresses: list[str], timeout_s: float) -> None:
        """Until the gateway lists each address as healthy (a new registration replaces an old one)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            listed = self.listed()
            if all(a in listed and listed[a].healthy for a in addresses):
                return
            time.sleep(0.1)
        raise TimeoutError(f"the gateway did not list {addresses} as healthy within {timeout_s:.0f} s")

    def stop(self, timeout_s: float = 10.0) -> list[str]:
        """SIGTERM (workers drain, then the gateway); returns a note for each process that needed SIGKILL."""
        children = [self.gateway, *self.workers.values()]
        stop_cluster(children, timeout_s)
        if self.redis:
            self.redis.stop()
        for channel in [self._registry_channel, *self._load_channels.values()]:
            channel.close()
        return [
            f"{c.name} (pid {c.proc.pid}) ended with exit code {c.proc.returncode} after SIGTERM (-9: still "
            f"running {timeout_s:.0f} s later, so killed); its last lines:\n  " + "\n  ".join(list(c.log)[-6:])
            for c in children
            if c.proc.returncode != 0
        ]


def wait_serving(address: str, proc, timeout_s: float) -> None:
    """launcher.wait_healthy with a fresh channel per try: a channel that met a dead port (a worker
    restarting on its old address) waits out gRPC's reconnect backoff, seconds after the port is up."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with grpc.insecure_channel(address) as channel:
            try:
                reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
        if proc.poll() is not None:
            raise RuntimeError(f"the worker for {address} exited with code {proc.returncode}")
        time.sleep(0.2)
    raise TimeoutError(f"{address} was not serving within {timeout_s:.0f} s")


DRAINED = re.compile(r"drained: free_blocks=(\d+) total_blocks=(\d+) running=0 waiting=0 awaiting_kv=0 held=0")


def drained_empty(child) -> bool:
    """The worker's last words: nothing running or held, and its KV pool fully free when it exited."""
    for line in child.log:
        m = DRAINED.search(line)
        if m:
            return m.group(1) == m.group(2)
    return False


def engine_core_pids(worker) -> list[int]:
    """The engine core process of a worker (its spawned children besides
    multiprocessing's resource tracker: one, once it started its core)."""
    spawned = ["pgrep", "-P", str(worker.proc.pid), "-f", "spawn_main"]
    return [int(p) for p in subprocess.run(spawned, capture_output=True, text=True).stdout.split()]


def engine_core_pid(worker) -> int:
    (core,) = engine_core_pids(worker)
    return core


def kill_engine_core(worker) -> None:
    """SIGKILL the engine core process of a worker."""
    os.kill(engine_core_pid(worker), signal.SIGKILL)


def wait_gone(pid: int, timeout_s: float) -> bool:
    """True once no process has this pid (an orphan is reaped by init once it exits)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def kill_engine_core_mid_stream(worker, stream) -> None:
    """SIGKILL worker's engine core while stream reads from it: the stream ends UNAVAILABLE and the
    worker leaves with exit code 3 (what `up` restarts)."""
    kill_engine_core(worker)
    try:
        for _ in stream:
            pass
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.UNAVAILABLE, e
    else:
        raise AssertionError("the stream ended OK after its engine core was killed")
    assert worker.proc.wait(30) == 3


# Roles the template knows; "tool" hits raise_exception, "ghost" an undefined attribute (UndefinedError).
CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'ghost' %}{{ m.nothing.deeper }}{% endif %}"
    "{% if m['role'] not in ['system', 'user', 'assistant', 'ghost'] %}"
    "{{ raise_exception('roles must be system, user or assistant') }}{% endif %}"
    "<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def write_chat_model(src, dst):
    """A copy of a tiny model folder with CHAT_TEMPLATE in its tokenizer_config.json."""
    shutil.copytree(src, dst)
    (dst / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    return dst


def big_text(num_bytes: int) -> str:
    """About num_bytes of plain words (a big prompt that tokenizes to many tokens)."""
    words, rng = "the quick brown fox jumps over the lazy dog paged attention".split(), random.Random(0)
    return " ".join(rng.choices(words, k=num_bytes // 3))[:num_bytes]
