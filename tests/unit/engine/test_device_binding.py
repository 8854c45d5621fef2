"""Every worker is bound to its GPU for its whole life: the launcher gives a child on cuda:N only that
GPU (CUDA_VISIBLE_DEVICES=N, --device cuda), workers sharing a GPU start one after another, and the
engine runs every step on one thread bound to its device. On CPU: children are not really spawned
(their argv and environment are captured) and torch.cuda.set_device is mocked."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest
import torch

from splitserve.common.sampling_params import SamplingParams
from splitserve.services.engine import model_runner, step_loop
from splitserve.services.engine.config import CacheConfig, EngineConfig
from splitserve.services.engine.core_client import EngineCoreClient
from splitserve.services.engine.engine import Engine
from splitserve.services.launcher import launcher, supervisor
from splitserve.services.launcher.launcher import Child, child_device, spawn_worker, start_cluster
from splitserve.services.launcher.supervisor import Supervisor


class FakeProc:
    returncode = None

    def poll(self):
        return None


@pytest.fixture
def spawned(monkeypatch) -> list[tuple[str, list[str], dict[str, str]]]:
    """(name, argv, env) of every child the launcher starts; nothing really starts."""
    calls = []

    def fake_spawn(name, argv, env, log=None, on_line=None):
        calls.append((name, argv, env))
        if on_line is not None:  # a worker: it says where it listens (a port of its own per call)
            port = 40000 + 2 * len(calls)
            on_line(f"worker ready: grpc 127.0.0.1:{port} metrics http://127.0.0.1:{port + 1}/metrics\n")
        return FakeProc()

    monkeypatch.setattr(launcher, "_spawn", fake_spawn)
    return calls


def test_a_worker_names_no_port_before_binding_it_and_says_where_it_listens(spawned):
    """Its command line (world-readable in /proc) names port 0; its Child learns the port from its ready line."""
    child = spawn_worker("worker-0", "unified", "127.0.0.1:1", [])
    ((_, argv, _),) = spawned
    assert argv[argv.index("--port") + 1] == "0" and argv[argv.index("--metrics-port") + 1] == "0"
    assert child.announced.is_set() and child.address == "127.0.0.1:40002" and child.metrics == "127.0.0.1:40003"
    for line_first in (True, False):  # the line may come before or after the Child is made
        announcement, later = launcher._Announcement(), Child("w", "", "", FakeProc())
        assert not later.announced.is_set()
        if line_first:
            announcement.read("worker ready: grpc 10.0.0.1:5 metrics http://10.0.0.1:6/metrics\n")
        announcement.read("[info] loading the model\n")
        announcement.attach(later)
        assert later.announced.is_set() == line_first
        announcement.read("worker ready: grpc 10.0.0.1:5 metrics http://10.0.0.1:6/metrics\n")
        assert later.announced.is_set() and (later.address, later.metrics) == ("10.0.0.1:5", "10.0.0.1:6")


def test_child_device_gives_one_gpu():
    env = {"PATH": "/bin"}
    assert child_device("cuda:3", env) == ("cuda", {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "3"})
    # The parent's cuda:1 is the second GPU of its own list.
    assert child_device("cuda:1", {"CUDA_VISIBLE_DEVICES": "4, 5,6"}) == ("cuda", {"CUDA_VISIBLE_DEVICES": "5"})
    with pytest.raises(ValueError, match="lists only 2 GPUs"):
        child_device("cuda:2", {"CUDA_VISIBLE_DEVICES": "0,1"})
    for device in ("cpu", "cuda", ""):
        assert child_device(device, env) == (device, env)


def test_child_device_gives_a_tensor_parallel_worker_its_gpus():
    # One GPU per rank, in rank order (rank r runs on the child's cuda:r), mapped through the parent's list.
    assert child_device("cuda:2,cuda:3", {}) == ("cuda", {"CUDA_VISIBLE_DEVICES": "2,3"})
    assert child_device("cuda:0,cuda:2", {"CUDA_VISIBLE_DEVICES": "4,5,6"}) == ("cuda", {"CUDA_VISIBLE_DEVICES": "4,6"})
    with pytest.raises(ValueError, match="lists only 2 GPUs"):
        child_device("cuda:1,cuda:2", {"CUDA_VISIBLE_DEVICES": "0,1"})


def test_pick_devices_puts_the_ranks_of_a_worker_on_distinct_devices():
    from collections import Counter

    from splitserve.services.launcher.launcher import pick_devices

    gpus, used = [f"cuda:{i}" for i in range(4)], Counter()
    # 1 prefill worker of 2 ranks, then 2 decode workers of 1: every GPU used once.
    assert [pick_devices(gpus, n, used) for n in (2, 1, 1)] == ["cuda:0,cuda:1", "cuda:2", "cuda:3"]
    assert pick_devices(gpus, 4, used) == "cuda:0,cuda:1,cuda:2,cuda:3"  # shares, each GPU once more
    with pytest.raises(ValueError, match="needs 4 distinct devices"):
        pick_devices(gpus[:2], 4, Counter())


def test_spawned_worker_sees_only_its_gpu(spawned):
    child = spawn_worker(
        "decode-0",
        "decode",
        "127.0.0.1:1",
        ["--model", "m", "--device", "auto"],
        env={"CUDA_VISIBLE_DEVICES": "0,1,2,3,4"},
        device="cuda:3",
    )
    ((_, argv, env),) = spawned
    assert env["CUDA_VISIBLE_DEVICES"] == "3"
    assert argv[-2:] == ["--device", "cuda"]  # the last --device wins over the one in argv
    assert child.device == "cuda:3"  # what the supervisor counts and restarts with
    spawn_worker("worker-0", "unified", "127.0.0.1:1", [], env={"X": "1"})
    _, argv, env = spawned[-1]
    assert "--device" not in argv and env == {"X": "1"}


def test_workers_sharing_a_gpu_start_one_after_another(spawned, monkeypatch):
    events = []
    monkeypatch.setattr(
        launcher, "wait_healthy", lambda address, timeout_s, proc=None, *rest, **kw: events.append(f"wait {address}")
    )
    monkeypatch.setattr(launcher.time, "sleep", lambda s: None)
    original = launcher.spawn_worker

    def spawn(name, *args, **kwargs):
        events.append(f"spawn {name}")
        return original(name, *args, **kwargs)

    monkeypatch.setattr(launcher, "spawn_worker", spawn)
    children = start_cluster(3, ["--model", "m"], devices=["cuda:0", "cuda:1"])
    w0, w1, w2 = children[1:]
    assert [c.device for c in (w0, w1, w2)] == ["cuda:0", "cuda:1", "cuda:0"]
    assert [env["CUDA_VISIBLE_DEVICES"] for _, _, env in spawned[1:]] == ["0", "1", "0"]
    # worker-1 (another GPU) starts at once; worker-2 waits until worker-0, on its GPU, is healthy.
    start = events.index("spawn worker-0")
    assert events[start : start + 4] == ["spawn worker-0", "spawn worker-1", f"wait {w0.address}", "spawn worker-2"]


def test_scaled_workers_sharing_a_gpu_start_one_after_another(spawned, monkeypatch):
    waited = []
    monkeypatch.setattr(supervisor, "wait_ready", lambda child, timeout_s, *rest, **kw: waited.append(child.address))
    monkeypatch.setattr(
        launcher,
        "wait_healthy",
        lambda address, timeout_s, proc=None, *rest, **kw: waited.append(f"before next: {address}"),
    )
    monkeypatch.setattr(supervisor.time, "sleep", lambda s: None)
    gateway = Child("gateway", "127.0.0.1:1", "127.0.0.1:2", FakeProc())
    sup = Supervisor([gateway], ["--model", "m"], "127.0.0.1", devices=["cuda:0"])
    first, second = sup._start("decode", 2)
    assert waited == [f"before next: {first.address}", first.address, second.address]
    assert [env["CUDA_VISIBLE_DEVICES"] for _, _, env in spawned] == ["0", "0"]


def test_resolve_device_pins_the_cuda_index(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert model_runner.resolve_device("cuda") == torch.device("cuda", 0)
    assert model_runner.resolve_device("cuda:2") == torch.device("cuda", 2)
    assert model_runner.resolve_device("cpu") == torch.device("cpu")


def test_bind_thread_sets_the_cuda_device(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    model_runner.bind_thread(torch.device("cpu"))
    assert calls == []
    model_runner.bind_thread(torch.device("cuda", 3))
    assert calls == [torch.device("cuda", 3)]


def test_every_step_runs_on_one_bound_thread(tiny_llama_dir, monkeypatch):
    engine = Engine(EngineConfig(model=str(tiny_llama_dir), cache=CacheConfig(block_size=8, kv_cache_bytes=2**21)))
    bound, step_threads = [], set()
    monkeypatch.setattr(step_loop, "bind_thread", lambda device: bound.append((threading.current_thread(), device)))
    real_step = engine.step

    def step():
        step_threads.add(threading.current_thread())
        return real_step()

    monkeypatch.setattr(engine, "step", step)

    async def main():
        aengine = EngineCoreClient.in_process(engine)  # its core's step loop

        async def one(prompt):
            return [o async for o in aengine.generate(prompt, SamplingParams(temperature=0, max_tokens=6))]

        await asyncio.gather(one([1, 2, 3]), one([4, 5]), one([6]))
        await aengine.shutdown()

    asyncio.run(main())
    ((thread, device),) = bound
    assert device == engine.runner.device and step_threads == {thread} and thread is not threading.main_thread()
    thread.join(timeout=5)  # shutdown ends it
    assert not thread.is_alive()


def test_an_engine_core_s_handoff_thread_is_bound_to_the_engine_s_device(monkeypatch):
    """A prefill or decode worker's core runs its KV handoffs on a thread of its own (pinned staging,
    side streams, NCCL groups): bound to the engine's device, or on a multi-GPU host every core would
    also make a CUDA context on device 0."""
    from splitserve.services.disagg import core_handoffs, rank_transfers

    bound = []

    def record(device: torch.device) -> None:
        bound.append((threading.current_thread(), device))

    monkeypatch.setattr(rank_transfers, "bind_thread", record)  # the loop thread's setup (start_loop_thread)

    async def where() -> threading.Thread:
        return threading.current_thread()

    loop = core_handoffs.CoreLoop("core-handoffs", SimpleNamespace(), torch.device("cuda", 3))  # type: ignore[arg-type]
    try:
        handoffs_thread = loop.run(where())
        ((thread, device),) = bound
        assert device == torch.device("cuda", 3) and thread is handoffs_thread and thread.name == "core-handoffs"
    finally:
        loop.close(lambda: asyncio.sleep(0))


def test_kv_transfer_threads_are_bound_to_the_worker_s_device(monkeypatch):
    """The transport builds its groups and moves every transfer on threads of its own (pinned
    staging, side streams, NCCL communicators are made there): each job runs bound to the device the
    worker's KV is on, or on a multi-GPU host it would make a CUDA context on device 0. A real gloo
    transfer of host tensors here (the device is only named)."""
    from splitserve.services.disagg.transfer import torch_dist

    bound: list[tuple[str, torch.device]] = []

    def record(device: torch.device) -> None:
        bound.append((threading.current_thread().name, device))

    monkeypatch.setattr(torch_dist, "bind_thread", record)
    device = torch.device("cuda", 3)

    async def main() -> None:
        receiver = torch_dist.TorchDistReceiver(timeout_s=20, device=device)
        sender = torch_dist.TorchDistSender(timeout_s=20, device=device)
        channel = receiver.channel_for("prefill-a")
        blocks, buffer = torch.randn(2, 2, 3, 4, 2, 8), torch.empty(2, 2, 3, 4, 2, 8)
        tag = receiver.next_tag(channel)
        await asyncio.gather(receiver.recv(channel, tag, buffer), sender.send(channel, tag, blocks))
        assert torch.equal(buffer, blocks)
        receiver.close(), sender.close()

    asyncio.run(main())
    # the receiver's group, the sender's group, the receive and the send
    assert len(bound) == 4 and {d for _, d in bound} == {device}
    assert all(name.startswith("kv-transfer") for name, _ in bound)
