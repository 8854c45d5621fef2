"""The gateway: public Generation API (gRPC, and the OpenAI HTTP API of http/), worker Registry,
health, reflection and /metrics.

Request path (generation.py, shared by both APIs): admission (--max-pending) -> validate + tokenize
once (validation.py) -> plan (planner.py) -> proxy the token stream (proxy.py). A request that fails
before any token reached the client is retried (up to three plans) on another plan that avoids the worker to
blame; after that, or once tokens went out, the client gets UNAVAILABLE.
The HTTP API runs on this process's event loop, beside the gRPC server.
Torch-free on purpose (a test checks sys.modules).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from splitserve.common.model_files import model_name
from splitserve.common.security import AccessGuard, ClusterSecurity, TlsIdentity
from splitserve.common.serving import start_metrics_server
from splitserve.common.tokenizer import load_tokenizer
from splitserve.common.tracing import context_from_metadata
from splitserve.gateway.auth import ApiKeys, PublicAccess
from splitserve.gateway.generation import Abort, GenerationCore, MigrationConfig
from splitserve.gateway.http.server import HttpApi, HttpSettings
from splitserve.gateway.metrics import GatewayMetrics
from splitserve.gateway.planner import LocalPrefill, Planner
from splitserve.gateway.prefix import PrefixIndex
from splitserve.gateway.proxy import Proxy
from splitserve.gateway.router import make_router
from splitserve.gateway.validation import RequestLimits, RequestValidator
from splitserve.gateway.workers import WorkerSet
from splitserve.protos.v1 import generation_pb2 as gen_pb
from splitserve.protos.v1 import generation_pb2_grpc as gen_grpc
from splitserve.protos.v1 import worker_pb2 as pb
from splitserve.protos.v1 import worker_pb2_grpc as pb_grpc

__all__ = ["GatewayConfig", "GatewayMetrics", "GatewaySecurity", "serve_gateway"]

log = logging.getLogger("splitserve.gateway")


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    model: str | None = None  # the served model (its tokenizer is loaded here); None: bundled SmolLM2
    host: str = "127.0.0.1"
    port: int = 0
    metrics_port: int = 0
    workers: tuple[str, ...] = ()  # worker addresses known at start (others register themselves)
    max_pending: int = 256  # requests in flight through this gateway before RESOURCE_EXHAUSTED
    router: str = "kv-aware"
    health_check_interval_s: float = 1.0
    forget_unhealthy_after_s: float = 30.0  # a worker unhealthy this long is dropped (it died without deregistering)
    redis_url: str | None = None  # prefix index in Redis; None: in this process's memory
    index_heartbeat_ttl_s: float = 5.0  # a worker silent this long drops out of the prefix index
    limits: RequestLimits = field(default_factory=RequestLimits)  # request sizes, checked before tokenizing
    max_streams_per_connection: int = 256  # HTTP/2 streams one client connection may have open at once
    security: GatewaySecurity = field(default_factory=lambda: GatewaySecurity())
    http_port: int | None = None  # the OpenAI-compatible HTTP API's port (0: a free one); None: no HTTP API
    http_cors_origins: tuple[str, ...] = ()  # browser origins allowed to call the HTTP API (CORS); none: off
    # The Registry's own port (0: a free one), served over the cluster's mTLS only, so members never meet
    # the gateway on its public port; None: the Registry shares the public port (and its transport).
    internal_port: int | None = None
    migration: MigrationConfig = field(default_factory=MigrationConfig)  # streams moved off a failed worker
    local_prefill: LocalPrefill = field(default_factory=LocalPrefill)  # conditional disaggregation (off)

    def __post_init__(self) -> None:
        if self.max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {self.max_pending}")
        if self.http_port is not None and not 0 <= self.http_port <= 65535:
            raise ValueError(f"http_port must be in [0, 65535] (or None: no HTTP API), got {self.http_port}")
        if self.max_streams_per_connection < 1:
            raise ValueError(f"max_streams_per_connection must be >= 1, got {self.max_streams_per_connection}")
        if self.internal_port is not None and self.security.cluster.identity is None:
            raise ValueError("--internal-port needs a cluster certificate: --cluster-ca, --cluster-cert, --cluster-key")


@dataclass(frozen=True, slots=True)
class GatewaySecurity:
    """The public API's TLS and keys, and the cluster's (docs/security.md). Defaults: open plaintext."""

    cluster: ClusterSecurity = field(default_factory=ClusterSecurity)
    tls: TlsIdentity | None = None  # the public API's certificate; None: the cluster's, else plaintext
    client_ca_pem: bytes | None = None  # public clients must present a certificate from this CA (mTLS)
    api_keys: ApiKeys | None = None  # None: Generation needs no key
    guard_open_services: bool = False  # health and reflection need a key too

    def public_identity(self, internal_port: bool) -> TlsIdentity | None:
        """The public API's certificate: --tls-cert's; without it, the cluster's only when members share
        the public port (no internal port), so the public API stays plaintext unless TLS is asked for."""
        return self.tls if internal_port else self.tls or self.cluster.identity

    def server_credentials(self, internal_port: bool = False) -> grpc.ServerCredentials | None:
        """The public port's credentials."""
        identity = self.public_identity(internal_port)
        if identity is None:
            if self.client_ca_pem is not None:
                raise ValueError("--tls-client-ca needs a server certificate (--tls-cert and --tls-key)")
            return None
        if self.client_ca_pem is None:
            return grpc.ssl_server_credentials([(identity.key_pem, identity.cert_pem)])
        # Without an internal port workers present cluster certificates here (a worker never holds a
        # public client's), so both CAs are trusted; each plane still checks its own secret.
        cluster_ca = None if internal_port else self.cluster.ca_pem
        roots = b"\n".join(filter(None, (self.client_ca_pem, cluster_ca)))
        return grpc.ssl_server_credentials(
            [(identity.key_pem, identity.cert_pem)], root_certificates=roots, require_client_auth=True
        )

    def public_access(self) -> PublicAccess | None:
        """The key check; make one per gateway and give it to both APIs, so a key's limits count both."""
        return PublicAccess(self.api_keys) if self.api_keys is not None else None

    def guard(self, public: PublicAccess | None) -> AccessGuard:
        return AccessGuard(self.cluster, (_REGISTRY,), public, self.guard_open_services)

    def internal_guard(self) -> AccessGuard:
        """The internal port's: the join secret on the Registry, from a certificate that names the cluster."""
        return AccessGuard(self.cluster, (_REGISTRY,), members_only=True)


_REGISTRY = pb.DESCRIPTOR.services_by_name["Registry"].full_name


class GenerationServicer(gen_grpc.GenerationServicer):
    """The gRPC face of GenerationCore (generation.py)."""

    def __init__(self, core: GenerationCore) -> None:
        self.core = core

    async def Generate(self, request: gen_pb.GenerateRequest, context: grpc.aio.ServicerContext):
        remaining = context.time_remaining()
        deadline = None if remaining is None else time.monotonic() + remaining
        try:
            parent = context_from_metadata(context.invocation_metadata())  # a traceparent the client sent
            async for response in self.core.generate(request, deadline, parent):
                yield response
        except Abort as e:
            if not context.done():  # past its deadline the client already has DEADLINE_EXCEEDED
                await context.abort(e.code, e.message)

    async def ListModels(self, request, context) -> gen_pb.ListModelsResponse:
        card = gen_pb.ModelCard(id=self.core.model_name, max_model_len=self.core.max_model_len())
        return gen_pb.ListModelsResponse(models=[card])

    async def Tokenize(self, request, context) -> gen_pb.TokenizeResponse:
        try:
            ids = await self.core.tokenize(request)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return gen_pb.TokenizeResponse(token_ids=ids)


class RegistryServicer(pb_grpc.RegistryServicer):
    def __init__(self, workers: WorkerSet, prefix: PrefixIndex) -> None:
        self.workers, self.prefix = workers, prefix

    async def RegisterWorker(self, request, context) -> pb.RegisterWorkerResponse:
        if not request.address:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "register with the worker's host:port in address")
        return pb.RegisterWorkerResponse(worker_id=self.workers.add(request).worker_id)

    async def DeregisterWorker(self, request, context) -> pb.DeregisterWorkerResponse:
        removed = await self.workers.remove(request.address)
        await self.prefix.remove_worker(request.address)
        return pb.DeregisterWorkerResponse(removed=removed)

    async def ListWorkers(self, request, context) -> pb.ListWorkersResponse:
        return pb.ListWorkersResponse(
            workers=[
                pb.WorkerInfo(
                    worker_id=w.worker_id,
                    address=w.address,
                    role=w.role.proto,
                    model=w.model,
                    healthy=w.healthy,
                    outstanding=w.outstanding,
                    load=w.load,
                    metrics_address=w.metrics_address,
                )
                for w in self.workers.all()
            ]
        )

    async def PublishKVEvents(self, request, context) -> pb.PublishKVEventsResponse:
        if not request.address or not request.instance_id or not request.block_size:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "publish with address, instance_id and block_size")
        known = self.workers.get(request.address) is not None
        return pb.PublishKVEventsResponse(resync=await self.prefix.publish(request), register=not known)


async def serve_gateway(config: GatewayConfig) -> None:
    name = model_name(config.model)
    security = config.security
    workers = WorkerSet(
        config.health_check_interval_s,
        channel_factory=security.cluster.worker_channel,
        forget_after_s=config.forget_unhealthy_after_s,
    )
    for address in config.workers:
        workers.add(pb.RegisterWorkerRequest(address=address, model=name))
    metrics = GatewayMetrics()
    prefix = PrefixIndex(name, config.redis_url, metrics.prefix, config.index_heartbeat_ttl_s)
    validator = RequestValidator(config.limits, load_tokenizer(config.model), name, workers)
    router = make_router(config.router)
    planner = Planner(name, workers, router, prefix, metrics.routed, metrics.local_prefills, config.local_prefill)
    core = GenerationCore(config.max_pending, validator, planner, Proxy(workers), metrics, config.migration)
    public = security.public_access()
    registry = RegistryServicer(workers, prefix)
    on_public = None if config.internal_port is not None else registry
    server, health_servicer = _grpc_server(config, core, on_public, public, metrics)
    credentials = security.server_credentials(internal_port=on_public is None)
    address = f"{config.host}:{config.port}"
    port = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    await server.start()
    internal = await _start_internal(config, registry, health_servicer) if on_public is None else None
    http = await _start_http(config, core, metrics, public)
    metrics_port = start_metrics_server(metrics.registry, config.host, config.metrics_port)
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    print(
        f"gateway ready: grpc {config.host}:{port}{' (TLS)' if credentials else ''} "
        f"{f'internal {config.host}:{internal.port} (mTLS) ' if internal else ''}"
        f"{http.describe() if http else 'http off'} "
        f"metrics http://{config.host}:{metrics_port}/metrics model {name}",
        flush=True,
    )
    checks = asyncio.create_task(workers.run_health_checks(prefix.remove_worker))
    purge = asyncio.create_task(prefix.run_purge(workers.is_live))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await health_servicer.enter_graceful_shutdown()
    checks.cancel()
    purge.cancel()
    stopping = [server.stop(grace=2.0), *([http.stop(grace_s=2.0)] if http else [])]
    await asyncio.gather(*stopping, *([internal.stop(grace=2.0)] if internal else []))
    await workers.close()
    await prefix.close()


@dataclass(frozen=True, slots=True)
class _InternalServer:
    server: grpc.aio.Server
    port: int

    async def stop(self, grace: float) -> None:
        await self.server.stop(grace=grace)


async def _start_internal(
    config: GatewayConfig, registry: RegistryServicer, health_servicer: health.aio.HealthServicer
) -> _InternalServer:
    """The Registry (and health) on the internal port, over the cluster's mTLS: a member verifies the
    gateway's certificate before its join secret leaves, and shows its own."""
    server = grpc.aio.server(interceptors=[config.security.internal_guard()])
    pb_grpc.add_RegistryServicer_to_server(registry, server)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    credentials = config.security.cluster.server_credentials()
    assert credentials is not None  # GatewayConfig checks an internal port comes with a cluster certificate
    port = server.add_secure_port(f"{config.host}:{config.internal_port}", credentials)
    await server.start()
    return _InternalServer(server, port)


def _grpc_server(
    config: GatewayConfig,
    core: GenerationCore,
    registry: RegistryServicer | None,
    public: PublicAccess | None,
    metrics: GatewayMetrics,
) -> tuple[grpc.aio.Server, health.aio.HealthServicer]:
    guard = config.security.guard(public)
    guard.on_denied = metrics.count_denial
    options = [
        # Big enough for every request within the limits; a bigger one ends in RESOURCE_EXHAUSTED from gRPC.
        ("grpc.max_receive_message_length", config.limits.max_message_bytes),
        ("grpc.max_concurrent_streams", config.max_streams_per_connection),
    ]
    server = grpc.aio.server(options=options, interceptors=[guard])
    gen_grpc.add_GenerationServicer_to_server(GenerationServicer(core), server)
    if registry is not None:  # else on the internal port only
        pb_grpc.add_RegistryServicer_to_server(registry, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = (
        gen_pb.DESCRIPTOR.services_by_name["Generation"].full_name,
        *([_REGISTRY] if registry is not None else []),
        health.SERVICE_NAME,
        reflection.SERVICE_NAME,
    )
    reflection.enable_server_reflection(names, server)
    return server, health_servicer


async def _start_http(
    config: GatewayConfig, core: GenerationCore, metrics: GatewayMetrics, public: PublicAccess | None
) -> HttpApi | None:
    if config.http_port is None:
        return None
    security = config.security
    return await HttpApi.start(
        HttpSettings(
            host=config.host,
            port=config.http_port,
            max_body_bytes=config.limits.max_message_bytes,
            guard_open_routes=security.guard_open_services,
            tls=security.public_identity(config.internal_port is not None),
            client_ca_pem=security.client_ca_pem,
            cors_origins=config.http_cors_origins,
        ),
        core,
        metrics,
        public,
    )
