"""A worker's prefix-index heartbeats keep coming while its engine is stuck in a long step
(services/worker/kv_events.py), so the index never purges a live worker; the purge metric tells the two
kinds of purge apart (gateway/prefix.py)."""

from __future__ import annotations

import asyncio
import time

import grpc

from splitserve.gateway.metrics import GatewayMetrics
from splitserve.gateway.prefix import PrefixIndex
from splitserve.gateway.server import RegistryServicer
from splitserve.gateway.workers import WorkerSet
from splitserve.protos.v1 import worker_pb2 as pb
from splitserve.protos.v1 import worker_pb2_grpc as pb_grpc
from splitserve.services.engine.async_engine import AsyncEngine
from splitserve.services.engine.config import CacheConfig, EngineConfig
from splitserve.services.engine.engine import Engine
from splitserve.services.engine.handoff_port import HandoffPort
from splitserve.services.worker.kv_events import KVEventPublisher

TTL_S = 1.0
STUCK_S = 3 * TTL_S  # one engine step this long (a big prefill on a busy CPU)
WORKER = "127.0.0.1:1"  # never called: health checks do not run here


def _purged(metrics: GatewayMetrics, live: str) -> float:
    return metrics.prefix.purged.labels(live=live)._value.get()


async def _run(tiny_llama_dir) -> tuple[GatewayMetrics, KVEventPublisher]:
    metrics = GatewayMetrics()
    workers = WorkerSet()
    prefix = PrefixIndex("tiny", None, metrics.prefix, heartbeat_ttl_s=TTL_S)
    server = grpc.aio.server()
    pb_grpc.add_RegistryServicer_to_server(RegistryServicer(workers, prefix), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    config = EngineConfig(model=str(tiny_llama_dir), max_model_len=256, cache=CacheConfig(block_size=8))
    engine = AsyncEngine(Engine(config))
    handoff_port = HandoffPort(engine)

    async def register() -> None:
        workers.add(pb.RegisterWorkerRequest(address=WORKER, model="tiny", block_size=handoff_port.block_size))

    await register()
    publisher = KVEventPublisher(handoff_port, f"127.0.0.1:{port}", WORKER, "tiny", register, heartbeat_s=0.2)
    tasks = [asyncio.create_task(publisher.run()), asyncio.create_task(prefix.run_purge(workers.is_live))]
    try:
        await asyncio.sleep(0.5)  # the first snapshot is in
        await engine.call(time.sleep, STUCK_S)  # the step thread is busy; the event loop is not
        await asyncio.sleep(TTL_S + 0.2)  # one more purge round after it
    finally:
        for task in tasks:
            task.cancel()
        await engine.shutdown()
        await server.stop(None)
    return metrics, publisher


def test_a_worker_stuck_in_a_long_step_is_not_purged(tiny_llama_dir):
    metrics, publisher = asyncio.run(_run(tiny_llama_dir))
    assert publisher.num_snapshots >= 1 and publisher.seq > STUCK_S / 0.2 / 2  # heartbeats went on meanwhile
    assert _purged(metrics, "true") == 0
    assert _purged(metrics, "false") == 0
