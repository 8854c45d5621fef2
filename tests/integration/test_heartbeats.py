"""A worker's prefix-index heartbeats keep coming while its engine is stuck in a long step
(services/worker/kv_events.py), so the index never purges a live worker; the purge metric tells the two
kinds of purge apart (gateway/prefix.py)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import grpc

from splitserve.common.sampling_params import SamplingParams
from splitserve.gateway.metrics import GatewayMetrics
from splitserve.gateway.prefix import PrefixIndex
from splitserve.gateway.server import RegistryServicer
from splitserve.gateway.workers import WorkerSet
from splitserve.protos.v1 import worker_pb2 as pb
from splitserve.protos.v1 import worker_pb2_grpc as pb_grpc
from splitserve.services.engine.config import CacheConfig, EngineConfig
from splitserve.services.engine.core_client import EngineCoreClient
from splitserve.services.engine.engine import Engine
from splitserve.services.worker.kv_events import KVEventPublisher

TTL_S = 1.0
HEARTBEAT_S = 0.2
# One engine step this long (a big prefill on a busy CPU): a purge round falls in it after a whole
# TTL without the step ending, so a worker whose heartbeats waited for the step would be purged.
STUCK_S = 2 * TTL_S + 0.5
WORKER = "127.0.0.1:1"  # never called: health checks do not run here


def _purged(metrics: GatewayMetrics, live: str) -> float:
    return metrics.prefix.purged.labels(live=live)._value.get()


class StuckStep:
    """Wraps Engine.step: once armed, the next step blocks (stuck is set) until released."""

    def __init__(self, step: Callable[[], list]) -> None:
        self._step = step
        self.armed, self.stuck, self.released = threading.Event(), threading.Event(), threading.Event()

    def __call__(self) -> list:
        if self.armed.is_set():
            self.armed.clear()
            self.stuck.set()
            self.released.wait(30)
        return self._step()


async def _until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def _run(tiny_llama_dir, monkeypatch) -> tuple[GatewayMetrics, KVEventPublisher, int]:
    """The beats sent while the step was stuck, with the index's metrics and the publisher."""
    metrics = GatewayMetrics()
    workers = WorkerSet()
    prefix = PrefixIndex("tiny", None, metrics.prefix, heartbeat_ttl_s=TTL_S)
    server = grpc.aio.server()
    pb_grpc.add_RegistryServicer_to_server(RegistryServicer(workers, prefix), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    config = EngineConfig(model=str(tiny_llama_dir), max_model_len=256, cache=CacheConfig(block_size=8))
    engine = Engine(config)
    stuck_step = StuckStep(engine.step)
    monkeypatch.setattr(engine, "step", stuck_step)
    client = EngineCoreClient.in_process(engine)  # the worker's engine reports, as from its core

    async def register() -> None:
        workers.add(pb.RegisterWorkerRequest(address=WORKER, model="tiny", block_size=client.block_size))

    await register()
    publisher = KVEventPublisher(client, f"127.0.0.1:{port}", WORKER, "tiny", register, heartbeat_s=HEARTBEAT_S)
    tasks = [asyncio.create_task(publisher.run()), asyncio.create_task(prefix.run_purge(workers.is_live))]
    try:
        await _until(lambda: publisher.num_snapshots >= 1)
        stuck_step.armed.set()
        request = asyncio.create_task(_drain(client.generate([1, 2, 3], SamplingParams(max_tokens=2))))
        assert await asyncio.to_thread(stuck_step.stuck.wait, 10)  # the step loop is busy; the event loop is not
        seq = publisher.seq
        await asyncio.sleep(STUCK_S)  # a purge round sees a whole TTL of the stuck step
        beats = publisher.seq - seq
        stuck_step.released.set()
        await request
    finally:
        stuck_step.released.set()
        for task in tasks:
            task.cancel()
        await client.shutdown()
        await server.stop(None)
    return metrics, publisher, beats


async def _drain(stream) -> None:
    async for _ in stream:
        pass


def test_a_worker_stuck_in_a_long_step_is_not_purged(tiny_llama_dir, monkeypatch):
    metrics, publisher, beats = asyncio.run(_run(tiny_llama_dir, monkeypatch))
    assert publisher.num_snapshots >= 1 and beats > STUCK_S / HEARTBEAT_S / 2  # heartbeats went on meanwhile
    assert _purged(metrics, "true") == 0
    assert _purged(metrics, "false") == 0
