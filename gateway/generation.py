"""The request path of Generate, whatever the transport: admission -> validate + tokenize once
(validation.py) -> plan (planner.py) -> proxy the token stream (proxy.py), with retries.

Both public APIs call it: the gRPC Generation servicer (server.py) and the OpenAI HTTP API (http/).
A request that fails before any token went out runs again on another plan that avoids every worker
blamed so far, up to MAX_ATTEMPTS plans (two workers draining at once, or a dead decode worker and
then a dead prefill worker, cost it nothing); after that, or once tokens went out, it ends with
Abort(UNAVAILABLE).
Closing or cancelling the stream cancels the worker call, which the worker treats as an abort: the
request's KV blocks go back to the pool on every tier.
An HTTP request's n samples of one prompt are n generations of one SharedPrompt: it is validated
and tokenized once, and each sample runs its own copy with its request id and seed.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass

import grpc
from opentelemetry import trace

from splitserve.common.tokenizer import Tokenizer
from splitserve.common.tracing import Context, SpanKind, fail, request_context, stage, steps_in, tracer
from splitserve.gateway.metrics import GatewayMetrics
from splitserve.gateway.planner import Planner
from splitserve.gateway.proxy import Abort, Proxy, WorkerFailed
from splitserve.gateway.validation import InvalidRequest, RequestLimits, RequestValidator
from splitserve.protos.v1 import generation_pb2 as gen_pb
from splitserve.protos.v1 import worker_pb2 as pb

__all__ = ["Abort", "Choice", "GenerationCore", "Refused", "SharedPrompt"]

log = logging.getLogger("splitserve.gateway")
NO_WORKER = (
    "no healthy worker can serve this model now; start one with `splitserve worker --gateway HOST:PORT` "
    "(unified, or a prefill and a decode worker) or wait for one to become healthy"
)


MAX_ATTEMPTS = 3  # plans per request while no token went out


class Refused(Abort):
    """INVALID_ARGUMENT from the validator, with its typed error (the HTTP API's error code)."""

    def __init__(self, error: ValueError) -> None:
        super().__init__(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        self.error = error

    def invalid_request(self) -> InvalidRequest | None:
        return self.error if isinstance(self.error, InvalidRequest) else None


class SharedPrompt:
    """One prompt with its parameters, validated and tokenized once for the choices (samples) that
    share it. The first choice to need it starts the validation; each choice then gets its own
    worker request, copied only once the prompt is known to fit the context (the last one to ask
    takes the original)."""

    def __init__(self, validator: RequestValidator, request: gen_pb.GenerateRequest, num_choices: int) -> None:
        self.validator, self.request, self._num_left = validator, request, num_choices
        self._validated: asyncio.Future[pb.WorkerGenerateRequest] | None = None

    async def worker_request(self, request_id: str, seed: int | None) -> pb.WorkerGenerateRequest:
        """Raises what the validation raised (ValueError), for every choice alike."""
        if self._validated is None:
            self._validated = asyncio.ensure_future(self.validator.worker_request(self.request, ""))
            self._validated.add_done_callback(_retrieve)  # every choice may have gone before it ends
        validated = await asyncio.shield(self._validated)  # one choice's cancellation is not the others'
        self._num_left -= 1
        request = validated if self._num_left == 0 else _copy(validated)
        request.request_id = request_id
        if seed is not None:
            request.params.seed = seed
        return request

    def num_prompt_tokens(self) -> int:
        """Once validated (a choice's stream has started); 0 before."""
        validated = self._validated
        if validated is None or not validated.done() or validated.cancelled() or validated.exception():
            return 0
        return len(validated.result().prompt_token_ids)


@dataclass(frozen=True, slots=True)
class Choice:
    """One sample of a SharedPrompt: what GenerationCore.generate runs for an HTTP choice."""

    prompt: SharedPrompt
    request_id: str
    seed: int | None  # the proto's uint64; None: unseeded


def _copy(request: pb.WorkerGenerateRequest) -> pb.WorkerGenerateRequest:
    copy = pb.WorkerGenerateRequest()
    copy.CopyFrom(request)
    return copy


def _retrieve(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()  # marks it retrieved: no "exception was never retrieved" at exit


class GenerationCore:
    """Generate for any transport; counts every request in the gateway's metrics by its gRPC code."""

    def __init__(
        self,
        max_pending: int,
        validator: RequestValidator,
        planner: Planner,
        proxy: Proxy,
        metrics: GatewayMetrics,
    ) -> None:
        self.max_pending, self.validator, self.planner, self.proxy = max_pending, validator, planner, proxy
        self.metrics = metrics
        self.num_pending = 0

    @property
    def model_name(self) -> str:
        return self.validator.model_name

    @property
    def tokenizer(self) -> Tokenizer:
        return self.validator.tokenizer

    def max_model_len(self) -> int:
        return self.validator.max_model_len()

    @property
    def limits(self) -> RequestLimits:
        return self.validator.limits

    async def tokenize(self, request: gen_pb.TokenizeRequest, add_special_tokens: bool = True) -> list[int]:
        """The prompt's token ids, checked as a Generate prompt is; raises ValueError."""
        return await self.validator.tokenize(request, add_special_tokens)

    def can_serve(self) -> bool:
        """Whether a request would find a plan now: a healthy worker that streams tokens (not prefill only)."""
        return self.planner.can_serve()

    def share(self, request: gen_pb.GenerateRequest, num_choices: int) -> SharedPrompt:
        return SharedPrompt(self.validator, request, num_choices)

    async def generate(
        self, request: gen_pb.GenerateRequest | Choice, deadline: float | None = None, parent: Context | None = None
    ) -> AsyncGenerator[gen_pb.GenerateResponse, None]:
        """The client's responses; raises Abort(code, message). request: a gRPC request, or one choice of
        an HTTP request. deadline: time.monotonic() by which the request must end (the worker call's
        timeout), None for none. parent: the trace context the client sent (the request's span is its
        child), None for none (the request's span starts a trace)."""
        arrival = time.monotonic()
        code = grpc.StatusCode.OK
        request_id = request.request_id or uuid.uuid4().hex
        span = tracer.start_span("gateway.generate", parent, SpanKind.SERVER)
        self.num_pending += 1
        self.metrics.pending.inc()
        try:
            # aclosing: a stream closed at a yield (an HTTP client gone) cancels the worker call now, not at GC
            ctx = request_context(span, request_id, parent)
            clock = self.metrics.latency.clock(arrival)
            async with aclosing(steps_in(ctx, self._generate(request, request_id, deadline, arrival))) as responses:
                async for response in responses:
                    clock.observe(response)
                    yield response
        except (asyncio.CancelledError, GeneratorExit):  # the client went away (HTTP closes the stream)
            code = grpc.StatusCode.CANCELLED
            span.add_event("cancelled")
            raise
        except Abort as e:
            code = e.code
            fail(span, f"{e.code.name}: {e.message}")
            raise
        finally:
            self.num_pending -= 1
            self.metrics.pending.dec()
            self.metrics.requests.labels(code=code.name).inc()
            span.set_attribute("rpc.grpc.status_code", code.value[0])
            span.end()

    async def _generate(
        self, request: gen_pb.GenerateRequest | Choice, request_id: str, deadline: float | None, arrival: float
    ) -> AsyncGenerator[gen_pb.GenerateResponse, None]:
        """Runs with the request's span current (steps_in): the stages' spans are its children."""
        with stage("gateway.validate"):
            worker_request = await self._validate(request, request_id)
        trace.get_current_span().set_attributes(
            {"splitserve.request_id": request_id, "splitserve.num_prompt_tokens": len(worker_request.prompt_token_ids)}
        )
        if self.num_pending > self.max_pending:
            raise Abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the gateway already has {self.max_pending} requests in flight; "
                "retry later or start it with a higher --max-pending",
            )
        avoid: set[str] = set()  # addresses of the workers blamed for a failed attempt
        for attempt in range(MAX_ATTEMPTS):
            with stage("gateway.plan", {"splitserve.attempt": attempt}):
                plan = await self.planner.plan(worker_request.prompt_token_ids, avoid, retry=attempt > 0)
            if plan is None:
                raise Abort(grpc.StatusCode.UNAVAILABLE, NO_WORKER)
            worker_request.prefill_address = plan.prefill.worker.address if plan.prefill else ""
            started = False
            try:
                async with aclosing(self.proxy.stream(plan, worker_request, deadline, arrival)) as responses:
                    async for response in responses:
                        started = True
                        yield response
                return
            except WorkerFailed as e:
                if started or attempt == MAX_ATTEMPTS - 1:
                    raise Abort(grpc.StatusCode.UNAVAILABLE, e.message) from None
                avoid.add(e.worker.address)
                self.metrics.retries.labels(role=e.worker.role_name).inc()
                log.warning(
                    "request %s: %s; retrying elsewhere (attempt %d of %d)",
                    worker_request.request_id,
                    e.message,
                    attempt + 2,
                    MAX_ATTEMPTS,
                )

    async def _validate(self, request: gen_pb.GenerateRequest | Choice, request_id: str) -> pb.WorkerGenerateRequest:
        try:
            if isinstance(request, Choice):
                return await request.prompt.worker_request(request_id, request.seed)
            return await self.validator.worker_request(request, request_id)
        except ValueError as e:
            raise Refused(e) from None
