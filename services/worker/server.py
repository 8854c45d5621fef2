"""Run a worker: load the engine, serve Worker + health + reflection, expose /metrics, register
with the gateway, drain on SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from splitserve.protos.v1 import worker_pb2 as pb
from splitserve.protos.v1 import worker_pb2_grpc as pb_grpc
from splitserve.services.config import EngineConfig
from splitserve.services.engine.async_engine import AsyncEngine
from splitserve.services.engine.engine import Engine
from splitserve.services.metrics import WorkerMetrics
from splitserve.services.model.files import model_name
from splitserve.services.serving import start_metrics_server
from splitserve.services.worker.servicer import WorkerServicer, engine_snapshot

log = logging.getLogger("splitserve.worker")

ROLES = {"unified": pb.WORKER_ROLE_UNIFIED}


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    engine: EngineConfig
    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port
    metrics_port: int = 0
    gateway: str | None = None  # host:port of the gateway's Registry
    mode: str = "unified"
    drain_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.mode not in ROLES:
            raise ValueError(f"--mode {self.mode!r} is not available yet; supported: {sorted(ROLES)}")


async def serve_worker(config: WorkerConfig) -> None:
    engine = AsyncEngine(Engine(config.engine))
    name = model_name(config.engine.model)
    metrics = WorkerMetrics(name, config.mode, lambda: engine_snapshot(engine))
    servicer = WorkerServicer(engine, metrics)
    server = grpc.aio.server()
    pb_grpc.add_WorkerServicer_to_server(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    services = (pb.DESCRIPTOR.services_by_name["Worker"].full_name, health.SERVICE_NAME, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(services, server)
    port = server.add_insecure_port(f"{config.host}:{config.port}")
    await server.start()
    metrics_port = start_metrics_server(metrics.registry, config.host, config.metrics_port)
    address = f"{config.host}:{port}"
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    print(f"worker ready: grpc {address} metrics http://{config.host}:{metrics_port}/metrics", flush=True)
    if config.gateway:
        await _register(config, address, f"{config.host}:{metrics_port}", name, engine.engine.runtime.max_model_len)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await _drain(config, servicer, health_servicer, engine, address)
    await server.stop(grace=1.0)
    await engine.shutdown()


async def _register(config: WorkerConfig, address: str, metrics_address: str, name: str, max_len: int) -> None:
    request = pb.RegisterWorkerRequest(address=address, role=ROLES[config.mode], model=name,
                                       max_model_len=max_len, metrics_address=metrics_address)
    async with grpc.aio.insecure_channel(config.gateway) as channel:
        stub = pb_grpc.RegistryStub(channel)
        for attempt in range(60):
            try:
                reply = await stub.RegisterWorker(request, timeout=2.0)
                log.info("registered with gateway %s as %s", config.gateway, reply.worker_id)
                return
            except grpc.aio.AioRpcError as e:
                log.warning("gateway %s not reachable yet (%s); retrying", config.gateway, e.code().name)
                await asyncio.sleep(min(0.2 * (attempt + 1), 2.0))
    raise RuntimeError(f"could not register with the gateway at {config.gateway}")


async def _drain(config, servicer, health_servicer, engine: AsyncEngine, address: str) -> None:
    """Stop taking requests, leave the gateway, let running requests finish (bounded)."""
    servicer.draining = True
    await health_servicer.enter_graceful_shutdown()
    if config.gateway:
        try:
            async with grpc.aio.insecure_channel(config.gateway) as channel:
                await pb_grpc.RegistryStub(channel).DeregisterWorker(
                    pb.DeregisterWorkerRequest(address=address), timeout=2.0)
        except grpc.aio.AioRpcError:
            pass  # the gateway's health checks drop us anyway
    deadline = asyncio.get_running_loop().time() + config.drain_timeout_s
    while engine.num_requests() and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.05)
