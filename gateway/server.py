"""The gateway: public Generation API, worker Registry, health, reflection and /metrics.

Request path: validate + tokenize once -> plan -> proxy the token stream. Sizes are checked before
tokenizing (validation.py), and any but a short prompt is tokenized on a thread: the event loop serves
every stream, so it never runs for long the one step whose cost grows with the client's input.
Plan: with healthy prefill and decode workers, a (prefill, decode) pair: the decode worker gets the
request with the prefill worker's address and runs the handoff. Otherwise one worker that runs
whole requests (unified, or decode when no prefill worker is up).
A request that fails before any token reached the client is retried once on another plan that
avoids the worker to blame; after that, or once tokens went out, the client gets UNAVAILABLE.
Torch-free on purpose (a test checks sys.modules).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry, Counter, Gauge
from splitserve.common.block_hash import hash_block_tokens
from splitserve.common.model_files import model_name
from splitserve.common.roles import Role
from splitserve.common.serving import start_metrics_server
from splitserve.common.tokenizer import Tokenizer, TooManyTokens, load_tokenizer
from splitserve.common.wire import FAILED_PEER_KEY, sampling_params_from_proto
from splitserve.gateway.prefix import PrefixIndex, PrefixIndexMetrics
from splitserve.gateway.router import Decision, RouteInput, Router, make_router
from splitserve.gateway.validation import (
    RequestLimits,
    check_fits_context,
    check_prompt_length,
    check_prompt_size,
    check_sizes,
    check_token_ids,
    clip,
)
from splitserve.gateway.workers import WorkerHandle, WorkerSet
from splitserve.protos.v1 import generation_pb2 as gen_pb
from splitserve.protos.v1 import generation_pb2_grpc as gen_grpc
from splitserve.protos.v1 import worker_pb2 as pb
from splitserve.protos.v1 import worker_pb2_grpc as pb_grpc

log = logging.getLogger("splitserve.gateway")
# Prompts up to this size (characters of text, bytes of chat messages) are tokenized on the event loop,
# in well under a millisecond: they skip the thread hop and never wait for a thread behind big prompts.
_INLINE_PROMPT_SIZE = 512
# Worker statuses that concern the request, not the worker: passed to the client as they are, with no
# retry and no mark against the worker (INTERNAL: the engine failed on this request and went on).
_PASS_THROUGH = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
                 grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.INTERNAL}


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
        self.requests = Counter("splitserve:gateway_requests", "Requests by final gRPC status code.",
                                ["code"], registry=self.registry)
        self.routed = Counter("splitserve:gateway_routing_decisions", "Requests routed, by worker and reason.",
                              ["worker", "reason"], registry=self.registry)
        self.pending = Gauge("splitserve:gateway_requests_in_flight", "Requests in flight.", registry=self.registry)
        self.prefix = PrefixIndexMetrics(self.registry)
        self.retries = Counter("splitserve:gateway_retries", "Requests retried on another worker before any "
                               "token went out, by the failed worker's role.", ["role"], registry=self.registry)


class GenerationServicer(gen_grpc.GenerationServicer):
    def __init__(self, config: GatewayConfig, tokenizer: Tokenizer, name: str, workers: WorkerSet,
                 router: Router, metrics: GatewayMetrics, prefix: PrefixIndex) -> None:
        self.config, self.tokenizer, self.model_name = config, tokenizer, name
        self.workers, self.router, self.metrics, self.prefix = workers, router, metrics, prefix
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
        except _Abort as e:
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
            raise _Abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                         f"the gateway already has {self.config.max_pending} requests in flight; "
                         "retry later or start it with a higher --max-pending")
        avoid: set[str] = set()
        for attempt in range(2):
            target, prefill = await self._plan(worker_request.prompt_token_ids, avoid)
            worker_request.prefill_address = prefill.worker.address if prefill else ""
            for d in (target, prefill):
                if d is not None:
                    self.metrics.routed.labels(worker=d.worker.worker_id, reason=d.reason + ("+retry" if attempt else "")).inc()
            started = False
            try:
                async for response in self._proxy(target.worker, prefill and prefill.worker, worker_request, context,
                                                  arrival):
                    started = True
                    yield response
                return
            except _WorkerFailed as e:
                if started or attempt == 1:
                    raise _Abort(grpc.StatusCode.UNAVAILABLE, e.message) from None
                avoid.add(e.worker.address)
                self.metrics.retries.labels(role=e.worker.role_name).inc()
                log.warning("request %s: %s; retrying once elsewhere", worker_request.request_id, e.message)

    async def _plan(self, prompt: Sequence[int], avoid: set[str]) -> tuple[Decision, Decision | None]:
        """(decision for the worker to stream from, decision for the prefill worker or None)."""
        healthy = [w for w in self.workers.healthy(self.model_name) if w.address not in avoid]
        prefills = [w for w in healthy if w.role is Role.PREFILL]
        decodes = [w for w in healthy if w.role is Role.DECODE]
        route = await self._route_input(prompt, healthy)
        if prefills and decodes:
            prefill, decode = self.router.pick(prefills, route, "prefill"), self.router.pick(decodes, route, "decode")
            self._observe_match(route, prefill)
            if route.matched is not None:  # the decode worker will hold the prompt's blocks too
                self.prefix.note_routed(route.block_hashes, decode.worker.address)
            return decode, prefill
        target = self.router.pick([w for w in healthy if w.role is not Role.PREFILL], route, "prefill")
        if target is None:
            raise _Abort(grpc.StatusCode.UNAVAILABLE, "no healthy worker can serve this model now; start one with "
                         "`splitserve worker --gateway HOST:PORT` (unified, or a prefill and a decode worker) "
                         "or wait for one to become healthy")
        self._observe_match(route, target)
        return target, None

    async def _route_input(self, prompt: Sequence[int], workers: list[WorkerHandle]) -> RouteInput:
        block_size = next((w.block_size for w in workers if w.block_size), 0)
        if not block_size or not self.router.uses_index:
            return RouteInput(prompt, len(prompt) // block_size if block_size else 0, None)
        hashes = hash_block_tokens(prompt, block_size)
        matched = await self.prefix.matches(hashes, block_size, [w.address for w in workers])
        return RouteInput(prompt, len(hashes), matched, hashes)

    def _observe_match(self, route: RouteInput, decision: Decision | None) -> None:
        if decision is None or route.matched is None:
            return
        self.metrics.prefix.matched.observe(route.matched.get(decision.worker.address, 0))
        self.prefix.note_routed(route.block_hashes, decision.worker.address)

    async def _validate(self, request: gen_pb.GenerateRequest) -> pb.WorkerGenerateRequest:
        try:
            check_sizes(request, self.config.limits)
            self._check_model(request.model)
            logprobs = request.logprobs if request.HasField("logprobs") else None
            params = sampling_params_from_proto(request.sampling, request.stopping, logprobs)
            check_token_ids(params.stop_token_ids, self._vocab_size(), "stop token ids")
            token_ids = await self._prompt_token_ids(request)
            check_prompt_length(len(token_ids), self._max_model_len())
            check_token_ids(token_ids, self._vocab_size(), "prompt token ids")
            check_fits_context(len(token_ids), params.max_tokens, self._max_model_len())
        except ValueError as e:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        return pb.WorkerGenerateRequest(
            request_id=request.request_id or uuid.uuid4().hex, prompt_token_ids=token_ids,
            sampling=request.sampling, stopping=request.stopping, priority=request.priority, logprobs=logprobs)

    def _check_model(self, model: str) -> None:
        if model and model != self.model_name:
            raise ValueError(f"unknown model {clip(model)!r}; this gateway serves {self.model_name!r}")

    async def _prompt_token_ids(self, request: gen_pb.GenerateRequest) -> list[int]:
        kind, max_len = request.WhichOneof("prompt"), self._max_model_len()
        if kind == "token_ids":
            check_prompt_length(len(request.token_ids.ids), max_len)  # before copying them all
            return list(request.token_ids.ids)
        limit = max_len - 1 if max_len else None  # a prompt leaves room for one generated token
        try:
            if kind == "text" and request.text:
                return await _off_loop_if_long(len(request.text), self.tokenizer.encode, request.text,
                                               max_num_tokens=limit)
            if kind == "chat" and request.chat.messages:
                return await _off_loop_if_long(request.chat.ByteSize(), self._encode_chat, request.chat, limit)
        except TooManyTokens as e:  # refused before its ids were built: give the usual message
            check_prompt_length(e.num_tokens, max_len)
            raise
        return []

    def _encode_chat(self, chat: gen_pb.ChatMessages, max_num_tokens: int | None = None) -> list[int]:
        """Rendering the template and tokenizing both grow with the messages (_off_loop_if_long)."""
        messages = [{"role": m.role, "content": m.content} for m in chat.messages]
        return self.tokenizer.encode_chat(messages, max_num_tokens=max_num_tokens)

    async def _proxy(self, worker: WorkerHandle, prefill: WorkerHandle | None, req: pb.WorkerGenerateRequest,
                     context, arrival: float):
        busy = [worker] + ([prefill] if prefill else [])
        for w in busy:
            w.outstanding += 1
        call = worker.stub.Generate(req, timeout=context.time_remaining())
        first_token_at = None
        try:
            async for chunk in call:
                now = time.monotonic()
                if first_token_at is None:
                    first_token_at = now
                    if prefill is not None:  # its part is done
                        prefill.outstanding -= 1
                        busy.remove(prefill)
                yield self._response(req.request_id, chunk, arrival, first_token_at, now)
        except grpc.aio.AioRpcError as e:
            if e.code() in _PASS_THROUGH:
                raise _Abort(e.code(), e.details()) from None
            blamed = _failed_peer(e) or worker.address
            failed = prefill if prefill is not None and blamed == prefill.address else worker
            self.workers.mark_failed(failed)
            raise _WorkerFailed(failed, f"{failed.role_name} worker {failed.worker_id} at {failed.address} failed "
                                f"during the request ({e.code().name}: {e.details()}); retry the request") from None
        finally:
            for w in busy:
                w.outstanding -= 1
            call.cancel()  # no-op when done; aborts the worker's request when the client went away

    @staticmethod
    def _response(request_id: str, chunk: pb.WorkerGenerateResponse, arrival: float, first_token_at: float,
                  now: float) -> gen_pb.GenerateResponse:
        response = gen_pb.GenerateResponse(request_id=request_id, text=chunk.text, token_ids=chunk.token_ids,
                                           logprobs=chunk.logprobs)
        if chunk.finish_reason != gen_pb.FINISH_REASON_UNSPECIFIED:
            response.finish_reason, response.stop_reason = chunk.finish_reason, chunk.stop_reason
            response.usage.CopyFrom(chunk.usage)
            response.timings.CopyFrom(gen_pb.Timings(queue_ms=chunk.queue_ms, ttft_ms=(first_token_at - arrival) * 1e3,
                                                     e2e_ms=(now - arrival) * 1e3))
        return response

    def _max_model_len(self) -> int:
        """The context the healthy workers accept (0 while none is known)."""
        return min((w.max_model_len for w in self.workers.healthy(self.model_name)), default=0)

    def _vocab_size(self) -> int:
        """Token ids the healthy workers accept are below this (0 while none is known)."""
        return min((w.vocab_size for w in self.workers.healthy(self.model_name) if w.vocab_size), default=0)

    async def ListModels(self, request, context) -> gen_pb.ListModelsResponse:
        card = gen_pb.ModelCard(id=self.model_name, max_model_len=self._max_model_len())
        return gen_pb.ListModelsResponse(models=[card])

    async def Tokenize(self, request, context) -> gen_pb.TokenizeResponse:
        try:
            check_prompt_size(request, self.config.limits)
            self._check_model(request.model)
            if request.WhichOneof("input") == "chat":
                ids = await _off_loop_if_long(request.chat.ByteSize(), self._encode_chat, request.chat)
            else:
                ids = await _off_loop_if_long(len(request.text), self.tokenizer.encode, request.text)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return gen_pb.TokenizeResponse(token_ids=ids)


async def _off_loop_if_long(size: int, encode, *args, **kwargs) -> list[int]:
    """encode(...) on a thread unless the prompt is short; the tokenizer releases the GIL, so the loop runs on."""
    if size <= _INLINE_PROMPT_SIZE:
        return encode(*args, **kwargs)
    return await asyncio.to_thread(encode, *args, **kwargs)


def _failed_peer(error: grpc.aio.AioRpcError) -> str | None:
    """The worker a decode worker blamed (a prefill worker), from the trailing metadata."""
    for key, value in error.trailing_metadata() or ():
        if key == FAILED_PEER_KEY:
            return value
    return None


class _WorkerFailed(Exception):
    def __init__(self, worker: WorkerHandle, message: str) -> None:
        super().__init__(message)
        self.worker, self.message = worker, message


class _Abort(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


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
        return pb.ListWorkersResponse(workers=[
            pb.WorkerInfo(worker_id=w.worker_id, address=w.address, role=w.role.proto, model=w.model, healthy=w.healthy,
                          outstanding=w.outstanding, load=w.load, metrics_address=w.metrics_address)
            for w in self.workers.all()])

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
        GenerationServicer(config, tokenizer, name, workers, make_router(config.router), metrics, prefix), server)
    pb_grpc.add_RegistryServicer_to_server(RegistryServicer(workers, prefix), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = (gen_pb.DESCRIPTOR.services_by_name["Generation"].full_name,
             pb.DESCRIPTOR.services_by_name["Registry"].full_name, health.SERVICE_NAME, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    port = server.add_insecure_port(f"{config.host}:{config.port}")
    await server.start()
    metrics_port = start_metrics_server(metrics.registry, config.host, config.metrics_port)
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    print(f"gateway ready: grpc {config.host}:{port} metrics http://{config.host}:{metrics_port}/metrics "
          f"model {name}", flush=True)
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
