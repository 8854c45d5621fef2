"""Run a worker: load the engine, serve Worker + health + reflection, expose /metrics, register
with the gateway, drain on SIGTERM.

Modes: unified (whole requests), prefill (the Prefill RPC; sends KV), decode (whole requests, and
requests whose prompt a prefill worker computes; hosts the TCPStore its KV channels meet through).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import signal
import socket
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from splitserve.common.model_files import model_name
from splitserve.common.roles import MODES, Role
from splitserve.common.security import AccessGuard, ClusterSecurity
from splitserve.common.serving import DRAIN_TIMEOUT_S, drain_bound_s, start_metrics_server
from splitserve.protos.v1 import worker_pb2 as pb
from splitserve.protos.v1 import worker_pb2_grpc as pb_grpc
from splitserve.services.disagg.decode import CoreDecodeSetup
from splitserve.services.disagg.prefill import CorePrefillSetup
from splitserve.services.disagg.rank_transfers import RankAgent
from splitserve.services.engine.config import EngineConfig
from splitserve.services.engine.core_client import STALL_TIMEOUT_S, EngineCoreClient
from splitserve.services.engine.core_process import CoreTraces, HandoffsSetup
from splitserve.services.engine.handoff_port import EngineLoad
from splitserve.services.worker.kv_events import KVEventPublisher
from splitserve.services.worker.metrics import CoreMetrics, WorkerMetrics, metric_labels
from splitserve.services.worker.servicer import WORKER_SERVICE, WorkerServicer, add_worker_service, engine_snapshot

log = logging.getLogger("splitserve.services.worker")

# Test hook: the prefill side waits this long before sending KV (a slow or stuck sender).
SEND_DELAY_ENV = "SPLITSERVE_FAULT_SEND_DELAY_S"


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    engine: EngineConfig
    host: str = "127.0.0.1"
    port: int = 0  # 0: any free port
    metrics_port: int = 0
    gateway: str | None = None  # host:port of the gateway's Registry
    advertise_host: str | None = None  # the host others reach this worker at; None: host (or this
    # machine's IP when host is 0.0.0.0, e.g. one replica of a scaled compose service)
    mode: str = "unified"
    drain_timeout_s: float = DRAIN_TIMEOUT_S  # running requests, once draining (KV in flight: drain_bound_s)
    kv_transfer_timeout_s: float = 30.0  # bounds every KV transfer wait (group setup, send, receive)
    kv_reserve_timeout_s: float = 10.0  # decode: how long a request may wait for room for its prompt
    kv_streaming: bool = True  # prefill: send the KV layer by layer as the last prompt chunk computes
    # An engine core silent this long while work is queued is hung or wedged: the worker stops serving
    # (health NOT_SERVING, out of the gateway) and exits non-zero, to be restarted.
    engine_stall_timeout_s: float = STALL_TIMEOUT_S
    vllm_metric_names: bool = False  # also export vLLM's metric names (services/worker/metrics.py VLLM_NAMES)
    cluster: ClusterSecurity = field(default_factory=ClusterSecurity)  # join secret, cluster mTLS
    otlp_traces_endpoint: str | None = None  # --otlp-traces-endpoint: an engine core exports its spans there too

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"--mode must be one of {list(MODES)}, got {self.mode!r}")
        if self.kv_transfer_timeout_s <= 0 or self.kv_reserve_timeout_s <= 0:
            raise ValueError("KV transfer and reserve timeouts must be > 0")
        if self.engine_stall_timeout_s <= 0:
            raise ValueError(f"the engine core's stall timeout must be > 0, got {self.engine_stall_timeout_s}")

    @property
    def role(self) -> Role:
        return Role(self.mode)

    @property
    def drain_bound_s(self) -> float:
        """Until then a drain waits for KV it holds or awaits (common/serving.py drain_bound_s)."""
        return drain_bound_s(self.drain_timeout_s, self.engine.cache.kv_lease_s, self.kv_transfer_timeout_s)

    @property
    def public_host(self) -> str:
        if self.advertise_host:
            return self.advertise_host
        if self.host in ("0.0.0.0", "::", ""):
            return socket.gethostbyname(socket.gethostname())
        return self.host


CORE_METRICS_TIMEOUT_S = 2.0  # a scrape's wait for the core's own metrics (a stalled core's are left out)


class EngineDied(RuntimeError):
    """The engine loop raised, or its core died or made no progress; the worker left the cluster and
    must exit non-zero (to be restarted)."""


def _start_engine(config: WorkerConfig) -> EngineCoreClient:
    """The engine in a core process of its own, which also runs a prefill or decode worker's KV
    handoffs: the KV leaves from and lands in the process that owns the cache."""
    engine_config = dataclasses.replace(config.engine, rank_agent=RankAgent)  # follower ranks move their KV heads
    handoffs: HandoffsSetup | None = None
    timeout_s = config.kv_transfer_timeout_s
    labels = metric_labels(model_name(config.engine.model), config.mode)  # the core's series, as the worker's
    if config.role is Role.DECODE:
        reserve_s = config.kv_reserve_timeout_s
        handoffs = CoreDecodeSetup(config.public_host, timeout_s, reserve_s, config.cluster, labels)
    elif config.role is Role.PREFILL:
        delay_s = float(os.environ.get(SEND_DELAY_ENV, "0") or 0)
        handoffs = CorePrefillSetup(config.public_host, timeout_s, config.kv_streaming, delay_s, labels)
    traces = CoreTraces(config.mode, config.otlp_traces_endpoint)  # the core's spans: its handoffs'
    stall_s = config.engine_stall_timeout_s  # the watchdog: a hung or wedged core ends as a dead one
    client = EngineCoreClient.launch(engine_config, handoffs=handoffs, traces=traces, stall_timeout_s=stall_s)
    client.start()
    return client


async def serve_worker(config: WorkerConfig) -> None:
    engine = _start_engine(config)
    name = model_name(config.engine.model)
    metrics = WorkerMetrics(name, config.mode, lambda: engine_snapshot(engine), vllm_names=config.vllm_metric_names)
    if config.role is not Role.UNIFIED:  # its KV handoffs run, and are counted, in its core
        loop = asyncio.get_running_loop()

        def core_exposition() -> bytes:  # on a scrape's thread
            exposition = asyncio.run_coroutine_threadsafe(engine.metrics_exposition(), loop)
            return exposition.result(CORE_METRICS_TIMEOUT_S)

        metrics.registry.register(CoreMetrics(core_exposition))
    servicer = WorkerServicer(engine, metrics, config.role)
    server = grpc.aio.server(interceptors=[AccessGuard(config.cluster, (WORKER_SERVICE,), members_only=True)])
    add_worker_service(servicer, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((WORKER_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    credentials = config.cluster.server_credentials()
    bind = f"{config.host}:{config.port}"
    grpc_port = server.add_secure_port(bind, credentials) if credentials else server.add_insecure_port(bind)
    await server.start()
    metrics_port = start_metrics_server(metrics.registry, config.host, config.metrics_port)
    address = f"{config.public_host}:{grpc_port}"
    stop = asyncio.Event()
    servicer.request_drain = stop.set  # the Drain RPC does what SIGTERM does
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    print(f"worker ready: grpc {address} metrics http://{config.public_host}:{metrics_port}/metrics", flush=True)
    publisher = None
    if config.gateway:

        async def register() -> None:
            await _register(config, address, f"{config.public_host}:{metrics_port}", name, engine)

        await register()
        events = KVEventPublisher(engine, config.gateway, address, name, register, config.cluster.gateway_channel)
        publisher = asyncio.create_task(events.run())
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    died = asyncio.ensure_future(engine.died.wait())
    await asyncio.wait({died, asyncio.ensure_future(stop.wait())}, return_when=asyncio.FIRST_COMPLETED)
    if publisher is not None:  # before deregistering, or it would register this worker again
        publisher.cancel()
    if died.done():
        await _leave_dead(config, health_servicer, server, address)
        raise EngineDied("the engine loop died (see the traceback above); the worker left the gateway")
    await _drain(config, servicer, health_servicer, address)
    await server.stop(grace=1.0)
    await engine.shutdown()
    log.info("drained: %s", _pool_report(engine.load()))  # the core closes its KV endpoints as it exits


async def _register(
    config: WorkerConfig, address: str, metrics_address: str, name: str, port: EngineCoreClient
) -> None:
    request = pb.RegisterWorkerRequest(
        address=address,
        role=config.role.proto,
        model=name,
        max_model_len=port.max_model_len,
        metrics_address=metrics_address,
        block_size=port.block_size,
        vocab_size=port.vocab_size,
    )
    assert config.gateway is not None
    async with config.cluster.gateway_channel(config.gateway) as channel:
        stub = pb_grpc.RegistryStub(channel)
        for attempt in range(60):
            try:
                reply = await stub.RegisterWorker(request, timeout=2.0)
                log.info("registered with gateway %s as %s", config.gateway, reply.worker_id)
                return
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.UNAUTHENTICATED:  # retrying cannot help
                    raise RuntimeError(f"the gateway at {config.gateway} refused this worker: {e.details()}") from None
                log.warning("gateway %s not reachable yet (%s); retrying", config.gateway, e.code().name)
                await asyncio.sleep(min(0.2 * (attempt + 1), 2.0))
    raise RuntimeError(f"could not register with the gateway at {config.gateway}")


async def _leave_dead(config: WorkerConfig, health_servicer, server, address: str) -> None:
    """Health NOT_SERVING, deregister, stop serving: nothing is routed to a worker that cannot step."""
    log.error("the engine loop died; leaving the gateway and exiting")
    await health_servicer.enter_graceful_shutdown()
    await _deregister(config, address)
    await server.stop(grace=0.5)


async def _deregister(config: WorkerConfig, address: str) -> None:
    if not config.gateway:
        return
    try:
        async with config.cluster.gateway_channel(config.gateway) as channel:
            await pb_grpc.RegistryStub(channel).DeregisterWorker(
                pb.DeregisterWorkerRequest(address=address), timeout=2.0
            )
    except grpc.aio.AioRpcError:
        pass  # the gateway's health checks drop us anyway


async def _drain(config: WorkerConfig, servicer: WorkerServicer, health_servicer, address: str) -> None:
    """Stop taking requests, leave the gateway, let running requests finish (for drain_timeout_s) and
    KV in flight land (for drain_bound_s: KV this worker holds or awaits is never cut off by the
    requests' deadline; its own lease and transfer timeouts end it sooner). The server still serves
    meanwhile: a prefill worker's Prefill streams report their sends."""
    servicer.draining = True
    await health_servicer.enter_graceful_shutdown()
    await _deregister(config, address)
    loop = asyncio.get_running_loop()
    requests_until, kv_until = loop.time() + config.drain_timeout_s, loop.time() + config.drain_bound_s

    def waiting() -> bool:
        now = loop.time()
        return (now < requests_until and bool(servicer.engine.num_requests())) or (
            now < kv_until and _moving_kv(servicer.engine.load())
        )

    while waiting():
        await asyncio.sleep(0.05)
    streaming, moving_kv = servicer.engine.num_requests(), _moving_kv(servicer.engine.load())
    if streaming or moving_kv:
        log.warning("drain: out of time with %d requests streaming (KV in flight: %s); stopping", streaming, moving_kv)


def _pool_report(load: EngineLoad) -> str:
    """One line the launcher's tests read: the KV pool must be empty when a drained worker exits."""
    return (
        f"free_blocks={load.num_free_blocks} total_blocks={load.num_total_blocks} running={load.num_running} "
        f"waiting={load.num_waiting} awaiting_kv={load.num_awaiting_kv} held={load.num_held_requests} "
        f"held_blocks={load.num_held_blocks} lease_expiries={load.num_lease_expiries}"
    )


def _moving_kv(load: EngineLoad) -> bool:
    """KV still to send (prefill: held blocks) or still landing (decode: asks, transfers in flight and
    reservations, all counted as awaiting KV by the engine that holds them)."""
    return bool(load.num_held_requests or load.num_awaiting_kv)
