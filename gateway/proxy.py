"""Proxying one attempt of a request: the worker's token stream, passed on as the client's responses.

A worker's error either concerns the request (passed to the client as it is: Abort) or the worker
(WorkerFailed, naming the worker to blame: the one called, or the prefill worker a decode worker
blamed); the server retries the latter once elsewhere if no token went out yet.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator

import grpc

from splitserve.common.tracing import SpanKind, ended, trace_metadata, tracer
from splitserve.common.wire import FAILED_PEER_KEY
from splitserve.gateway.planner import Plan
from splitserve.gateway.workers import WorkerHandle, WorkerSet
from splitserve.protos.v1 import generation_pb2 as gen_pb
from splitserve.protos.v1 import worker_pb2 as pb

# Worker statuses that concern the request, not the worker: passed to the client as they are, with no
# retry and no mark against the worker (INTERNAL: the engine failed on this request and went on).
_PASS_THROUGH = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.INTERNAL,
}


class Abort(Exception):
    """Ends the client's call with this status and message."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


class WorkerFailed(Exception):
    """A worker failed at the transport level (already marked failed): retry elsewhere, or give up."""

    def __init__(self, worker: WorkerHandle, message: str) -> None:
        super().__init__(message)
        self.worker, self.message = worker, message


class Proxy:
    def __init__(self, workers: WorkerSet) -> None:
        self.workers = workers

    async def stream(
        self,
        plan: Plan,
        req: pb.WorkerGenerateRequest,
        deadline: float | None,
        arrival: float,
        first_token_at: float | None = None,
    ) -> AsyncGenerator[gen_pb.GenerateResponse, None]:
        """deadline: time.monotonic() by which the worker call must end (None: no timeout); first_token_at:
        when the stream's first token went out, for a migrated stream (its time to first token). The
        attempt's span is a child of the current one (the request's); the worker's spans are its children."""
        worker, prefill = plan.target.worker, plan.prefill_worker
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        span = tracer.start_span("gateway.attempt", kind=SpanKind.CLIENT, attributes=_attributes(plan))
        with ended(span), self.workers.lease(*(d.worker for d in plan.decisions)) as lease:
            sent_at = time.monotonic()
            call = worker.stub.Generate(req, timeout=timeout, metadata=trace_metadata(span))
            first: float | None = None  # this attempt's first token
            try:
                async for chunk in call:
                    now = time.monotonic()
                    if first is None:
                        first = now
                        span.add_event("first token")
                        if prefill is not None:  # its part is done
                            lease.release(prefill)
                    yield _response(req.request_id, chunk, (arrival, sent_at, first_token_at or first, now))
            except grpc.aio.AioRpcError as e:
                raise self._failure(e, worker, prefill) from None
            finally:
                call.cancel()  # no-op when done; aborts the worker's request when the client went away

    def _failure(
        self, error: grpc.aio.AioRpcError, worker: WorkerHandle, prefill: WorkerHandle | None
    ) -> Abort | WorkerFailed:
        if error.code() in _PASS_THROUGH:
            return Abort(error.code(), error.details() or "")
        blamed = _failed_peer(error) or worker.address
        failed = prefill if prefill is not None and blamed == prefill.address else worker
        self.workers.mark_failed(failed)
        return WorkerFailed(
            failed,
            f"{failed.role_name} worker {failed.worker_id} at {failed.address} failed "
            f"during the request ({error.code().name}: {error.details()}); retry the request",
        )


def _attributes(plan: Plan) -> dict[str, str]:
    """The attempt span's: which workers, and why the router picked them."""
    attributes = {
        "splitserve.services.worker": plan.target.worker.address,
        "splitserve.route_reason": plan.target.reason,
    }
    if plan.prefill is not None:
        attributes |= {"splitserve.prefill_worker": plan.prefill.worker.address}
        attributes |= {"splitserve.prefill_route_reason": plan.prefill.reason}
    return attributes


def _response(
    request_id: str, chunk: pb.WorkerGenerateResponse, times: tuple[float, float, float, float]
) -> gen_pb.GenerateResponse:
    """times: (arrival at the gateway, worker call sent, first token, now), time.monotonic()."""
    response = gen_pb.GenerateResponse(
        request_id=request_id, text=chunk.text, token_ids=chunk.token_ids, logprobs=chunk.logprobs
    )
    if chunk.finish_reason != gen_pb.FINISH_REASON_UNSPECIFIED:
        response.finish_reason, response.stop_reason = chunk.finish_reason, chunk.stop_reason
        response.usage.CopyFrom(chunk.usage)
        arrival, sent_at, first_token_at, now = times
        response.timings.CopyFrom(
            gen_pb.Timings(
                queue_ms=chunk.queue_ms,
                ttft_ms=(first_token_at - arrival) * 1e3,
                e2e_ms=(now - arrival) * 1e3,
                stages=chunk.stages,
            )
        )
        response.timings.stages.gateway_queue_ms = (sent_at - arrival) * 1e3
    return response


def _failed_peer(error: grpc.aio.AioRpcError) -> str | None:
    """The worker a decode worker blamed (a prefill worker), from the trailing metadata."""
    for key, value in error.trailing_metadata() or ():
        if key == FAILED_PEER_KEY and isinstance(value, str):  # str: the key has no -bin suffix
            return value
    return None
