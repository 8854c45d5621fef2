"""Kernel variants and the engine warm-up (issue 20, items 7 and 8): split counts are powers of two that
the warm-up reaches one by one, the SM count is asked once per device, the warm-up leaves the engine's
output unchanged, and a worker reports SERVING only after it. On CPU the kernels run under the Triton
interpreter (tests/conftest.py); on CUDA compiled (make gpu-check runs this file there)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from splitserve.services.engine.config import CacheConfig, EngineConfig

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


# -- the worker ----------------------------------------------------------------------------------------
def test_worker_is_serving_only_after_its_warm_up(tiny_llama_dir, monkeypatch):
    """The engine core's launch returns once the core has warmed up and said it is ready; the worker
    says SERVING only after it."""
    import grpc
    from grpc_health.v1 import health, health_pb2

    from splitserve.common.serving import free_port
    from splitserve.protos.v1 import worker_pb2, worker_pb2_grpc
    from splitserve.services.engine.core_client import EngineCoreClient
    from splitserve.services.worker import server

    events: list[object] = []

    real_launch = EngineCoreClient.launch.__func__

    def launch(cls, *args, **kwargs):
        client = real_launch(cls, *args, **kwargs)
        events.append("warm_up")  # the core sends CoreReady only after its warm-up
        return client

    monkeypatch.setattr(EngineCoreClient, "launch", classmethod(launch))

    real_set = health.aio.HealthServicer.set

    async def set_status(self, service, status):
        events.append(("health", status))
        await real_set(self, service, status)

    monkeypatch.setattr(health.aio.HealthServicer, "set", set_status)
    engine = EngineConfig(model=str(tiny_llama_dir), cache=CacheConfig(block_size=8, kv_cache_bytes=2 * 1024**2))
    config = server.WorkerConfig(engine=engine, port=free_port())

    async def run() -> None:
        task = asyncio.create_task(server.serve_worker(config))
        while ("health", health_pb2.HealthCheckResponse.SERVING) not in events:
            assert not task.done(), task.exception()
            await asyncio.sleep(0.05)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{config.port}") as channel:
            await worker_pb2_grpc.WorkerStub(channel).Drain(worker_pb2.DrainRequest(), timeout=10)
        await asyncio.wait_for(task, 30)

    asyncio.run(run())
    assert events.index("warm_up") < events.index(("health", health_pb2.HealthCheckResponse.SERVING))


# -- make gpu-check ------------------------------------------------------------------------------------
@pytest.mark.skipif(DEVICE == "cuda", reason="checks the message a CPU machine gets")
def test_gpu_check_without_cuda_exits_with_a_message(tmp_path):
    script = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.py"
    out = tmp_path / "gpu_check.json"
    done = subprocess.run(
        [sys.executable, str(script), "--json", str(out)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2
    assert "no CUDA device" in done.stderr and "make test" in done.stderr
    assert not out.exists()
