"""The gateway: public Generation API, worker Registry, health, reflection and /metrics.

Request path: admission (--max-pending) -> validate + tokenize once (validation.py) -> plan
(planner.py) -> proxy the token stream (proxy.py). A request that fails before any token reached
the client is retried once on another plan that avoids the worker to blame; after that, or once
tokens went out, the client gets UNAVAILABLE.
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
from prometheus_client import CollectorRegistry, Counter, Gauge

from splitserve.common.model_files import model_name
from splitserve.common.roles import Role
from splitserve.common.serving import start_metrics_server
from splitserve.common.tokenizer import Tokenizer, load_tokenizer
from splitserve.gateway.planner import Planner
from splitserve.gateway.prefix import PrefixIndex, PrefixIndexMetrics
from splitserve.gateway.proxy import Abort, Proxy, WorkerFailed
from splitserve.gateway.router import Router, make_router
from splitserve.gateway.validation import RequestLimits, RequestValidator
from splitserve.gateway.workers import WorkerSet
from splitserve.protos.v1 import generation_pb2 as gen_pb
from splitserve.protos.v1 import generation_pb2_grpc as gen_grpc
from splitserve.protos.v1 import worker_pb2 as pb
from splitserve.protos.v1 import worker_pb2_grpc as pb_grpc

log = logging.getLogger("splitserve.gateway")
_NO_WORKER = (
    "no healthy worker can serve this model now; start one with `splitserve worker --gateway HOST:PORT` "
    "(unified, or a prefill and a decode worker) or wait for one to become healthy"
)


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
    redis_url: str | None = None  # prefix index in Redis; None: in this process's memory
    index_heartbeat_ttl_s: float = 5.0  # a worker silent this long drops out of the prefix index
    limits: RequestLimits = field(default_factory=RequestLimits)  # request sizes, checked before tokenizing

    def __post_init__(self) -> None:
        if self.max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {self.max_pending}")


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "splitserve_gateway_requests", "Requests by final gRPC status code.", ["code"], registry=self.registry
        )
        self.routed = Counter(
            "splitserve_gateway_routing_decisions",
            "Requests routed, by worker and reason.",
            ["worker", "reason"],
            registry=self.registry,
        )
        self.pending = Gauge("splitserve_gateway_requests_in_flight", "Requests in flight.", registry=self.registry)
        self.prefix = PrefixIndexMetrics(self.registry)
        self.retries = Counter(
            "splitserve_gateway_retries",
            "Requests retried on another worker before any token went out, by the failed worker's role.",
            ["role"],
            registry=self.registry,
        )
        for role in Role:  # at zero from the start: a retry is rare, and rate() needs a series to see one
            self.retries.labels(role=role.value)


class GenerationServicer(gen_grpc.GenerationServicer):
    def __init__(
        self,
        config: GatewayConfig,
        tokenizer: Tokenizer,
        name: str,
        workers: WorkerSet,
        router: Router,
        metrics: GatewayMetrics,
        prefix: PrefixIndex,
    ) -> None:
        self.config, self.metrics = config, metrics
        self.validator = RequestValidator(config.limits, tokenizer, name, workers)
        self.planner = Planner(name, workers, router, prefix, metrics.routed)
        self.proxy = Proxy(workers)
        self.num_pending = 0

    async def Generate(self, request: gen_pb.GenerateRequest, context: grpc.aio.ServicerContext):
        arrival = time.monotonic()
        code = grpc.StatusCode.OK
        self.num_pending += 1
        self.metrics.pending.inc()
        try:
            async for response in self._generate(request, context, arrival):
                yield response
        except asyncio.CancelledError:
            code = grpc.StatusCode.CANCELLED
            raise
        except Abort as e:
            code = e.code
            if not context.done():  # past its deadline the client already has DEADLINE_EXCEEDED
                await context.abort(e.code, e.message)
        finally:
            self.num_pending -= 1
            self.metrics.pending.dec()
            self.metrics.requests.labels(code=code.name).inc()

    async def _generate(self, request, context, arrival: float):
        worker_request = await self._validate(request)
        if self.num_pending > self.config.max_pending:
            raise Abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the gateway already has {self.config.max_pending} requests in flight; "
                "retry later or start it with a higher --max-pending",
            )
        avoid: set[str] = set()  # addresses of the workers blamed for a failed attempt
        for attempt in range(2):
            plan = await self.planner.plan(worker_request.prompt_token_ids, avoid, retry=attempt > 0)
            if plan is None:
                raise Abort(grpc.StatusCode.UNAVAILABLE, _NO_WORKER)
            worker_request.prefill_address = plan.prefill.worker.address if plan.prefill else ""
            started = False
            try:
                async for response in self.proxy.stream(plan, worker_request, context, arrival):
                    started = True
                    yield response
                return
            except WorkerFailed as e:
                if started or attempt == 1:
                    raise Abort(grpc.StatusCode.UNAVAILABLE, e.message) from None
                avoid.add(e.worker.address)
                self.metrics.retries.labels(role=e.worker.role_name).inc()
                log.warning("request %s: %s; retrying once elsewhere", worker_request.request_id, e.message)

    async def _validate(self, request: gen_pb.GenerateRequest) -> pb.WorkerGenerateRequest:
        try:
            return await self.validator.worker_request(request)
        except ValueError as e:
            raise Abort(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None

    async def ListModels(self, request, context) -> gen_pb.ListModelsResponse:
        card = gen_pb.ModelCard(id=self.validator.model_name, max_model_len=self.validator.max_model_len())
        return gen_pb.ListModelsResponse(models=[card])

    async def Tokenize(self, request, context) -> gen_pb.TokenizeResponse:
        try:
            ids = await self.validator.tokenize(request)
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
    tokenizer = load_tokenizer(config.model)
    name = model_name(config.model)
    workers = WorkerSet(config.health_check_interval_s)
    for address in config.workers:
        workers.add(pb.RegisterWorkerRequest(address=address, model=name))
    metrics = GatewayMetrics()
    prefix = PrefixIndex(name, config.redis_url, metrics.prefix, config.index_heartbeat_ttl_s)
    # Big enough for every request within the limits; a bigger one ends in RESOURCE_EXHAUSTED from gRPC.
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", config.limits.max_message_bytes)])
    gen_grpc.add_GenerationServicer_to_server(
        GenerationServicer(config, tokenizer, name, workers, make_router(config.router), metrics, prefix), server
    )
    pb_grpc.add_RegistryServicer_to_server(RegistryServicer(workers, prefix), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = (
        gen_pb.DESCRIPTOR.services_by_name["Generation"].full_name,
        pb.DESCRIPTOR.services_by_name["Registry"].full_name,
        health.SERVICE_NAME,
        reflection.SERVICE_NAME,
    )
    reflection.enable_server_reflection(names, server)
    port = server.add_insecure_port(f"{config.host}:{config.port}")
    await server.start()
    metrics_port = start_metrics_server(metrics.registry, config.host, config.metrics_port)
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    print(
        f"gateway ready: grpc {config.host}:{port} metrics http://{config.host}:{metrics_port}/metrics model {name}",
        flush=True,
    )
    checks = asyncio.create_task(workers.run_health_checks())
    purge = asyncio.create_task(prefix.run_purge())
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await health_servicer.enter_graceful_shutdown()
    checks.cancel()
    purge.cancel()
    await server.stop(grace=2.0)
    await workers.close()
    await prefix.close()
