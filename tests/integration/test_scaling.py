"""Scaling tiers of a running system without failing requests: add workers, drain the originals
(SIGTERM and the Drain RPC), and `splitserve up` + `splitserve scale` + `splitserve workers`."""

from __future__ import annotations

import random
import subprocess
import sys
import threading
import time

import grpc
from cluster_helpers import drained_empty, engine_argv, greedy_request, metric, stub, tokens

from splitserve.common.serving import free_port
from splitserve.protos.v1 import worker_pb2 as wpb
from splitserve.protos.v1 import worker_pb2_grpc as wpb_grpc
from splitserve.services.launcher.launcher import start_cluster, stop_cluster, wait_healthy
from splitserve.services.launcher.supervisor import Supervisor


class SteadyLoad:
    """Two client threads sending requests back to back until stopped; records every outcome."""

    def __init__(self, address: str) -> None:
        self.stub, self.stop, self.outcomes = stub(address), threading.Event(), []
        self.threads = [threading.Thread(target=self._loop, args=(i,)) for i in range(2)]

    def _loop(self, i: int) -> None:
        rng = random.Random(i)  # fresh prompts: repeats would (rightly) stick to the cache-holding workers
        n = 0
        while not self.stop.is_set():
            prompt = [rng.randrange(3, 300) for _ in range(12 + n % 20)]
            try:
                self.outcomes.append(len(tokens(self.stub, greedy_request(prompt, 6), timeout=30)) == 6)
            except grpc.RpcError as e:
                self.outcomes.append(f"{e.code().name}: {e.details()}")
            n += 1

    def __enter__(self) -> SteadyLoad:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)


def _moved_kv(child) -> float:
    return metric(child.metrics, "splitserve_kv_transfer_blocks_total")


def test_add_workers_then_drain_the_originals_under_load(tiny_llama_dir):
    children = start_cluster(0, engine_argv(tiny_llama_dir), num_prefill=1, num_decode=1)
    supervisor = Supervisor(children, engine_argv(tiny_llama_dir), "127.0.0.1")
    original_p, original_d = children[1], children[2]
    try:
        with SteadyLoad(children[0].address) as load:
            time.sleep(2)
            started, _ = supervisor.scale({"prefill": 2, "decode": 2})
            assert sorted(c.mode for c in started) == ["decode", "prefill"]
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not all(_moved_kv(c) > 0 for c in started):
                time.sleep(0.5)
            assert all(_moved_kv(c) > 0 for c in started), "new workers got no traffic"
            # their engines count each step by kind (what the planner refits on)
            kinds = {c.mode: metric(c.metrics, "splitserve_engine_steps_total", kind=c.mode) for c in started}
            assert kinds["prefill"] > 0 and kinds["decode"] > 0, kinds
            # Drain the originals: the prefill one over the Drain RPC, the decode one by SIGTERM.
            wpb_grpc.WorkerStub(grpc.insecure_channel(original_p.address)).Drain(wpb.DrainRequest(), timeout=5)
            original_d.proc.terminate()
            for child in (original_p, original_d):
                assert child.proc.wait(timeout=90) == 0
            before = len(load.outcomes)
            time.sleep(3)  # traffic keeps flowing through the new workers
            assert len(load.outcomes) > before, [(c.name, c.proc.poll()) for c in supervisor.children]
        failures = [o for o in load.outcomes if o is not True]
        assert not failures and len(load.outcomes) > 10, failures[:3]
        assert drained_empty(original_p) and drained_empty(original_d)
    finally:
        stop_cluster(supervisor.children)


def test_up_scale_and_workers_commands(tiny_llama_dir, tmp_path):
    port, admin, internal = free_port(), free_port(), free_port()
    up = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "splitserve.services.launcher.cli",
            "up",
            "--workers",
            "1",
            "--port",
            str(port),
            "--admin-port",
            str(admin),
            "--internal-port",
            str(internal),
            "--secrets-dir",
            str(tmp_path),
            *engine_argv(tiny_llama_dir),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    cli = [sys.executable, "-m", "splitserve.services.launcher.cli"]
    try:
        wait_healthy(f"127.0.0.1:{port}", 120, up)
        member = ["--join-secret-file", str(tmp_path / "join-secret")]  # `up` made it: 0600
        member += ["--cluster-ca", str(tmp_path / "ca.pem"), "--cluster-cert", str(tmp_path / "cluster.pem")]
        member += ["--cluster-key", str(tmp_path / "cluster-key.pem")]  # the launcher takes mTLS only
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # the launcher control starts once the workers are up
            if subprocess.run([*cli, "health", f"127.0.0.1:{admin}", *member], capture_output=True).returncode == 0:
                break
            time.sleep(0.5)
        assert (tmp_path / "join-secret").stat().st_mode & 0o777 == 0o600
        outsider = subprocess.run(
            [*cli, "scale", "--url", f"127.0.0.1:{admin}", "--decode", "2"], capture_output=True, text=True, timeout=60
        )
        assert outsider.returncode == 1 and "UNAVAILABLE" in outsider.stderr  # no certificate: no handshake
        no_secret = member[2:]  # the cluster certificate without the join secret
        outsider = subprocess.run(
            [*cli, "workers", "--url", f"127.0.0.1:{internal}", *no_secret], capture_output=True, text=True
        )
        assert outsider.returncode == 1 and "UNAUTHENTICATED" in outsider.stderr
        out = subprocess.run(
            [*cli, "scale", "--url", f"127.0.0.1:{admin}", *member, "--prefill", "1", "--decode", "1"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert out.returncode == 0, out.stderr
        assert "now: 1 unified, 1 prefill, 1 decode" in out.stdout
        time.sleep(1.5)
        listing = subprocess.run(
            [*cli, "workers", "--url", f"127.0.0.1:{internal}", *member], capture_output=True, text=True
        )
        roles = sorted(line.split()[1] for line in listing.stdout.splitlines()[1:])
        assert roles == ["decode", "prefill", "unified"], listing.stdout
        out = subprocess.run(
            [*cli, "scale", "--url", f"127.0.0.1:{admin}", *member, "--workers", "0"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert out.returncode == 0 and "drained worker-0" in out.stdout, out
        bad = subprocess.run(
            [*cli, "scale", "--url", f"127.0.0.1:{admin}", *member, "--decode", "0"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert bad.returncode == 1 and "INVALID_ARGUMENT" in bad.stderr
    finally:
        up.terminate()
        up.wait(120)


def test_workers_are_spread_over_devices(tiny_llama_dir):
    from collections import Counter

    from splitserve.services.launcher.launcher import parse_devices, pick_devices

    assert parse_devices("cuda:0, cuda:1") == ["cuda:0", "cuda:1"] and parse_devices(None) is None
    used: Counter[str] = Counter()
    assert [pick_devices(["cuda:0", "cuda:1"], 1, used) for _ in range(3)] == ["cuda:0", "cuda:1", "cuda:0"]
    children = start_cluster(2, engine_argv(tiny_llama_dir), devices=["cpu"])  # the only device here
    supervisor = Supervisor(children, engine_argv(tiny_llama_dir), "127.0.0.1", devices=["cpu", "meta"])
    try:
        assert [c.device for c in children[1:]] == ["cpu", "cpu"]
        assert pick_devices(supervisor.devices, 1, supervisor._device_use()) == "meta"  # where a new worker goes
        assert len(tokens(stub(children[0].address), greedy_request([1, 2, 3], 3))) == 3
    finally:
        stop_cluster(children)
