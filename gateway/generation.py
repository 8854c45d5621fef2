"""The request path of Generate, whatever the transport: admission -> validate + tokenize once
(validation.py) -> plan (planner.py) -> proxy the token stream (proxy.py), with retries.

Both public APIs call it: the gRPC Generation servicer (server.py) and the OpenAI HTTP API (http/).
A request that fails before any token went out runs again on another plan that avoids every worker
blamed so far, up to MAX_ATTEMPTS plans (two workers draining at once, or a dead decode worker and
then a dead prefill worker, cost it nothing); after that it ends with Abort(UNAVAILABLE).
A stream whose worker fails after tokens went out migrates (Migration): the gateway sends the prompt
and what the client already has (a Continuation) to another worker, which computes the prompt and
those tokens itself and streams on from the exact point of failure, on the same random draws
(a sampled request's draws are keyed by its seed and position; an unseeded one gets a seed here), up
to `migration_limit` times a stream.
Closing or cancelling the stream cancels the worker call, which the worker treats as an abort: the
request's KV blocks go back to the pool on every tier.
An HTTP request's n samples of one prompt are n generations of one SharedPrompt: it is validated
and tokenized once, and each sample runs its own copy with its request id and seed.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import uuid
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass

import grpc
from opentelemetry import trace

from splitserve.common.sampling_params import GREEDY_TEMPERATURE
from splitserve.common.tokenizer import Tokenizer
from splitserve.common.tracing import Context, SpanKind, fail, request_context, stage, steps_in, tracer
from splitserve.gateway.metrics import GatewayMetrics
from splitserve.gateway.planner import Plan, Planner
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


@dataclass(frozen=True, slots=True)
class MigrationConfig:
    """limit: migrations per stream (0: off); max_tokens: the longest stream (prompt + output tokens)
    the gateway tracks for one, so a stream's memory here stays bounded."""

    limit: int = 3
    max_tokens: int = 32768

    def __post_init__(self) -> None:
        if self.limit < 0 or self.max_tokens < 1:
            raise ValueError(f"migration limit must be >= 0 and max tokens >= 1, got {self.limit}, {self.max_tokens}")


class _Sent:
    """What the client has of one stream: its output tokens and text length, while tracked."""

    def __init__(self, max_tokens: int, num_prompt_tokens: int) -> None:
        self.room = max_tokens - num_prompt_tokens  # output tokens tracked before giving up
        self.token_ids: list[int] | None = []  # None: too long to track
        self.num_text_chars = 0
        self.first_token_at: float | None = None
        self.finished = False  # its last response went out (a failure after it ends nothing)

    def add(self, response: gen_pb.GenerateResponse) -> None:
        if self.first_token_at is None:
            self.first_token_at = time.monotonic()
        self.finished = response.finish_reason != gen_pb.FINISH_REASON_UNSPECIFIED
        if self.token_ids is None:
            return
        if len(self.token_ids) + len(response.token_ids) > self.room:
            self.token_ids = None
            return
        self.token_ids.extend(response.token_ids)
        self.num_text_chars += len(response.text)

    def continuation(self, request: pb.WorkerGenerateRequest) -> pb.WorkerGenerateRequest:
        """The request, carrying what the client has (only while tracked: _migrate checks)."""
        moved = _copy(request)
        moved.continuation.output_token_ids[:] = self.token_ids or ()
        moved.continuation.num_text_chars = self.num_text_chars
        return moved


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


NOT_MOVED = "the stream could not move to another worker (the gateway's --migration-limit or --migration-max-tokens)"


def _greedy(params: pb.EngineSamplingParams) -> bool:
    return params.HasField("temperature") and params.temperature < GREEDY_TEMPERATURE


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
        migration: MigrationConfig = MigrationConfig(),
    ) -> None:
        self.max_pending, self.validator, self.planner, self.proxy = max_pending, validator, planner, proxy
        self.metrics, self.migration = metrics, migration
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
        if not worker_request.params.HasField("seed") and not _greedy(worker_request.params):
            worker_request.params.seed = secrets.randbits(64)  # so that a migrated stream keeps its draws
        avoid: set[str] = set()  # addresses of the workers blamed for a failed attempt
        sent = _Sent(self.migration.max_tokens, len(worker_request.prompt_token_ids))
        num_retries = num_migrations = 0
        while True:
            call = worker_request if sent.first_token_at is None else sent.continuation(worker_request)
            plan = await self._plan(call, avoid, num_retries + num_migrations)
            call.prefill_address = plan.prefill.worker.address if plan.prefill else ""
            try:
                async with aclosing(self.proxy.stream(plan, call, deadline, arrival, sent.first_token_at)) as responses:
                    async for response in responses:
                        sent.add(response)
                        yield response
                return
            except WorkerFailed as e:
                if sent.finished:  # the worker died after the stream's last response: the client has it all
                    return
                avoid.add(e.worker.address)
                if sent.first_token_at is None:
                    num_retries += 1
                    self._retry(request_id, e, num_retries)
                else:
                    num_migrations += 1
                    self._migrate(request_id, e, sent, num_migrations)

    async def _plan(self, call: pb.WorkerGenerateRequest, avoid: set[str], attempt: int) -> Plan:
        """The attempt's plan: a migrated stream's (a continuation) goes to one worker that computes
        its prompt and tokens so far itself."""
        moving = call.HasField("continuation")
        with stage("gateway.plan", {"splitserve.attempt": attempt, "splitserve.migrated": moving}):
            prompt = [*call.prompt_token_ids, *call.continuation.output_token_ids] if moving else call.prompt_token_ids
            plan = await self.planner.plan(prompt, avoid, retry=attempt > 0, migrated=moving)
        if moving:
            self.metrics.migrations.labels(outcome="resumed" if plan else "no_worker").inc()
        if plan is None:
            raise Abort(grpc.StatusCode.UNAVAILABLE, NO_WORKER)
        return plan

    def _retry(self, request_id: str, error: WorkerFailed, num_retries: int) -> None:
        """Before any token went out: again on another plan, up to MAX_ATTEMPTS plans."""
        if num_retries == MAX_ATTEMPTS:
            raise Abort(grpc.StatusCode.UNAVAILABLE, error.message) from None
        self.metrics.retries.labels(role=error.worker.role_name).inc()
        log.warning(
            "request %s: %s; retrying elsewhere (attempt %d of %d)",
            request_id,
            error.message,
            num_retries + 1,
            MAX_ATTEMPTS,
        )

    def _migrate(self, request_id: str, error: WorkerFailed, sent: _Sent, num_migrations: int) -> None:
        """After tokens went out: the stream moves on, up to the migration limit, while tracked."""
        if sent.token_ids is None or num_migrations > self.migration.limit:
            self.metrics.migrations.labels(outcome="too_long" if sent.token_ids is None else "limit").inc()
            raise Abort(grpc.StatusCode.UNAVAILABLE, f"{error.message}; {NOT_MOVED}") from None
        log.warning(
            "request %s: %s; moving its stream after %d tokens elsewhere (migration %d of %d)",
            request_id,
            error.message,
            len(sent.token_ids),
            num_migrations,
            self.migration.limit,
        )

    async def _validate(self, request: gen_pb.GenerateRequest | Choice, request_id: str) -> pb.WorkerGenerateRequest:
        try:
            if isinstance(request, Choice):
                return await request.prompt.worker_request(request_id, request.seed)
            return await self.validator.worker_request(request, request_id)
        except ValueError as e:
            raise Refused(e) from None
