"""Prefill tier: compute a prompt, hand its first token and KV blocks to a decode worker.

Lifecycle of a request here: waiting -> running (chunked prefill) -> held (finished at its first
token; blocks kept under a lease) -> sent (every piece, each from its rank) -> released (the whole
handoff: services/disagg/handoff.py).

In the engine core process (CorePrefillSetup, CorePrefill, below): the serving process keeps the
gRPC call; the core computes the prompt and sends its KV from the process that owns the cache,
running prefill_and_send (the pair groups built while the prompt computes, the send
streamed layer by layer from the step computing the prompt's last chunk, the held blocks released
once sent) on a thread of its own with an asyncio loop. The prompt's first token is processed in
the core (services/disagg/core_handoffs.py CorePrompts, fed each step's tokens before they leave): a prompt
ends at its first token, and what the call streams is that token, not text.

What crosses the pipe (services/engine/core_process.py): the Prefill call as the worker received it;
each event of the call as it streams it (CorePrefillEvent: SendStarted, FirstToken,
TransferDone, serialized PrefillResponses); a failure as a refusal with its status code
(INVALID_ARGUMENT: a job this worker cannot serve; UNAVAILABLE: the send failed; INTERNAL: the step
failed for it), which the serving process ends the call with, as it would in one process; an abort
(the call is gone), which aborts a prompt still computing and ends its send (one still waiting to
join its channel ends at once; bytes already moving finish first), releasing its blocks, as in one
process. The send's metrics are counted here, in the core's registry (services/disagg/metrics.py).

Its spans join the request's trace (services/disagg/core_handoffs.py). A tensor-parallel prefill worker's
follower ranks are the core's children: the core opens their KV endpoints and orders their sends
(streamed ones from the step loop, before the step reaches them), as a serving process does in one
process.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from prometheus_client import CollectorRegistry

from splitserve.common.tracing import stage, tracer
from splitserve.protos.v1 import engine_core_pb2 as cpb
from splitserve.services.disagg.core_handoffs import CoreLoop, CorePrompts
from splitserve.services.disagg.handoff import FirstToken, HandoffEvent, HandoffJob, SendStarted, TransferDone
from splitserve.services.disagg.metrics import KVTransferMetrics
from splitserve.services.disagg.plan import check_fits
from splitserve.services.disagg.prefill_client import event_to_proto, job_from_proto
from splitserve.services.disagg.rank_transfers import (
    Endpoint,
    PieceReport,
    connect_piece,
    open_rank_endpoints,
    send_order,
    send_piece,
)
from splitserve.services.disagg.transfer.base import KVSender, TransferError, TransferFailure
from splitserve.services.disagg.transfer.isolated import make_sender
from splitserve.services.engine.core_process import Send, refusal
from splitserve.services.engine.engine import Engine, RequestOutput
from splitserve.services.engine.handoff_port import HandoffPort
from splitserve.services.engine.layer_progress import LayerProgress
from splitserve.services.engine.outputs import StepTokens
from splitserve.services.engine.ranks import Message
from splitserve.services.engine.request import Request
from splitserve.services.engine.step_loop import StepLoop
from splitserve.services.engine.streams import RequestFailed

log = logging.getLogger("splitserve.prefill")


async def prefill_and_send(
    steps: StepLoop,
    prompts: CorePrompts,
    request: Request,
    sender: KVSender,
    job: HandoffJob,
    metrics: KVTransferMetrics,
    send_delay_s: float = 0.0,
    stream: bool = False,
) -> AsyncIterator[HandoffEvent]:
    """Yield FirstToken, then TransferDone. request comes from HandoffPort.make_prefill_request; the
    prompt runs on the core's step loop, its first token processed by prompts.
    stream: send the KV layer by layer while the step computing the prompt's last chunk runs (every
    rank its own pieces); SendStarted comes first then, as soon as that step is scheduled.
    Raises ValueError for a bad job, TransferError if the send fails. send_delay_s is a
    fault-injection hook for tests (a slow or stuck sender)."""
    port = HandoffPort(steps)
    _check_job(port, job)
    sender.use_device(port.device)  # an NCCL channel's group is built on it
    for piece in job.pieces:
        connect_piece(port, sender, piece)  # build the pairs' groups while the prompt computes
    rid = request.request_id

    def send(block_ids: Sequence[int], step: StreamedStep | None) -> asyncio.Task:
        task = asyncio.create_task(
            _send(port, sender, job, rid, block_ids[job.num_skip_blocks :], metrics, send_delay_s, step)
        )
        task.add_done_callback(_consume_error)  # if our caller is gone, nobody else awaits it
        return task

    streamed = _stream_from_step(port, job, request, send) if stream else asyncio.get_running_loop().create_future()
    started_ns = time.time_ns()
    run = asyncio.ensure_future(prompts.run(steps, request))
    sending: asyncio.Task | None = None
    sent = False
    try:
        try:
            first_done: list[asyncio.Future[Any]] = [run, streamed]
            await asyncio.wait(first_done, return_when=asyncio.FIRST_COMPLETED)
            if streamed.done():
                yield SendStarted(max(request.num_prompt_blocks - job.num_skip_blocks, 0))
            final = await run
        finally:
            run.cancel()  # a no-op once done; else the caller left: the prompt is aborted
        _trace_compute(started_ns, final)
        if final.handoff is None:
            raise RuntimeError(f"request {rid} ended without its KV ({final.finish_reason})")
        sending = streamed.result() if streamed.done() else send(final.handoff.block_ids, None)
        logprobs = final.new_logprobs[0] if final.new_logprobs else None
        queue_ms, ttft_ms = final.timings.queue_ms, final.timings.ttft_ms
        compute_ms = 0.0 if ttft_ms is None else ttft_ms - queue_ms
        num_blocks = len(final.handoff.block_ids[job.num_skip_blocks :])
        yield FirstToken(final.new_token_ids[0], logprobs, num_blocks, queue_ms, compute_ms)
        done = await asyncio.shield(sending)  # a cancel reaches the send below, where it waits
        sent = True
        yield done
    finally:
        if not sent:  # the call is gone (aborted, its decode worker lost) or failed: nobody takes the KV
            _abandon_send(sending, streamed)


def _stream_from_step(
    port: HandoffPort,
    job: HandoffJob,
    request: Request,
    send: Callable[[Sequence[int], StreamedStep], asyncio.Task],
) -> asyncio.Future[asyncio.Task]:
    """The send's task, once the step computing the prompt's last chunk is scheduled: the followers
    are ordered on the step thread before that step reaches them, then send starts rank 0's on the
    event loop, even if the caller is gone by then (the sender releases the blocks)."""
    streamed: asyncio.Future[asyncio.Task] = asyncio.get_running_loop().create_future()
    followers = [i for i, piece in enumerate(job.pieces) if piece.piece.src_rank != 0]

    def follower_orders(block_ids: Sequence[int]) -> list[tuple[int, tuple[np.ndarray, ...]]]:
        """On the step thread: STREAM_KV for each follower's piece."""
        sent = block_ids[job.num_skip_blocks :]
        return [(job.pieces[i].piece.src_rank, send_order(job.pieces[i], sent)) for i in followers] if sent else []

    def start(block_ids: Sequence[int], layers: LayerProgress, streaming: list[Future[Message]]) -> None:
        streamed.set_result(send(block_ids, StreamedStep(layers, dict(zip(followers, streaming)))))

    port.stream_as_computed(request, start, follower_orders)
    return streamed


@dataclass(frozen=True, slots=True)
class StreamedStep:
    """A send streamed from the step computing the prompt's last chunk: rank 0 reads its pieces as
    layers marks them written; each follower piece (by its index in the job) was ordered before that
    step (STREAM_KV), and its reply comes in followers."""

    layers: LayerProgress
    followers: dict[int, Future[Message]]


def _check_job(port: HandoffPort, job: HandoffJob) -> None:
    if job.kv_layout != port.kv_layout:
        raise ValueError(
            f"KV layout mismatch: the decode worker has {job.kv_layout}, this prefill worker "
            f"has {port.kv_layout}; run both tiers with the same model, dtype and --block-size"
        )
    check_fits([p.piece for p in job.pieces], port.num_kv_heads, port.tensor_parallel_size, job.decode_size)


def _trace_compute(started_ns: int, final: RequestOutput) -> None:
    """The engine's queue time and compute time (to the first token), after the fact, as two spans."""
    scheduled_ns = started_ns + int(final.timings.queue_ms * 1e6)
    ttft_ms = final.timings.ttft_ms
    first_token_ns = time.time_ns() if ttft_ms is None else started_ns + int(ttft_ms * 1e6)
    tracer.start_span("prefill.queue", start_time=started_ns).end(end_time=scheduled_ns)
    tokens = {
        "splitserve.num_prompt_tokens": final.num_prompt_tokens,
        "splitserve.num_cached_tokens": final.num_cached_tokens,  # prefix cache hits: not computed
    }
    tracer.start_span("prefill.compute", start_time=scheduled_ns, attributes=tokens).end(end_time=first_token_ns)


def _abandon_send(sending: asyncio.Task | None, streamed: asyncio.Future[asyncio.Task]) -> None:
    """End the send of a call that is gone where it waits (joining its channel, whose rendezvous may
    be dead: TCPStore retries it for more than the transfer timeout), so the held blocks are released
    now; bytes already moving finish first (the transport waits for them). A streamed send not
    started yet is ended once its step starts it. The cancel is scheduled, not made: a task just
    created has not run its first step, and a cancel before it would skip the release of its blocks."""
    loop = asyncio.get_running_loop()
    if sending is None and streamed.done():
        sending = streamed.result()
    if sending is not None:
        loop.call_soon(sending.cancel)
    elif not streamed.cancelled():
        streamed.add_done_callback(lambda started: loop.call_soon(started.result().cancel))


def _consume_error(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()


async def _send(
    port: HandoffPort,
    sender: KVSender,
    job: HandoffJob,
    request_id: str,
    block_ids: Sequence[int],
    metrics: KVTransferMetrics,
    send_delay_s: float,
    step: StreamedStep | None,
) -> TransferDone:
    """Sends the held blocks (a streamed send's were claimed when its step was scheduled), under its
    span (a child of the Prefill call's: this task inherits its context)."""
    attributes = {"splitserve.num_blocks": len(block_ids), "splitserve.streamed": step is not None}
    with stage("prefill.kv_send", attributes) as span:
        started = time.monotonic()
        try:
            if step is None and not await port.claim_held(request_id):
                raise TransferError(
                    TransferFailure.CLOSED,
                    f"the KV of request {request_id} was released before its "
                    "send started (its lease expired or it was aborted)",
                )
            try:
                if send_delay_s:
                    await asyncio.sleep(send_delay_s)
                layers, streaming = (None, {}) if step is None else (step.layers, step.followers)
                sends = (
                    send_piece(port, sender, piece, block_ids, layers, streaming.get(i))
                    for i, piece in enumerate(job.pieces)
                )
                results = await asyncio.gather(*sends, return_exceptions=True)
            finally:  # every piece sent or failed; the decode worker gets TransferDone before the release is done
                port.release_held_soon(request_id)
            done = _observe_sent(job, block_ids, _reports(results, metrics), metrics, step is not None)
        except Exception as e:  # the decode worker recomputes; this side's log says why and how long it took
            elapsed = time.monotonic() - started
            log.warning("request %s: KV send failed after %.2f s (%s: %s)", request_id, elapsed, type(e).__name__, e)
            raise
        span.set_attributes({"splitserve.num_bytes": done.num_bytes, "splitserve.transfer_ms": done.seconds * 1e3})
    return done


def _observe_sent(
    job: HandoffJob, block_ids: Sequence[int], reports: list[PieceReport], metrics: KVTransferMetrics, streamed: bool
) -> TransferDone:
    """The sender's report of the pieces sent, counted."""
    done = TransferDone(
        len(block_ids),
        sum(r.num_bytes for r in reports),
        tuple(r.checksum for r in reports),
        max((r.seconds for r in reports), default=0.0),
    )
    metrics.observe_transfer("sent", done.num_blocks, done.num_bytes, done.seconds)
    if streamed:
        metrics.observe_streamed_send()
    for piece, report in zip(job.pieces, reports):
        metrics.observe_rank_bytes("sent", piece.piece.src_rank, report.num_bytes)
    return done


def _reports(results: list, metrics: KVTransferMetrics) -> list[PieceReport]:
    """The pieces' reports, or the first failure raised (each counted once per handoff)."""
    for result in results:
        if isinstance(result, BaseException) and not isinstance(result, TransferError):
            raise result
    errors = [r for r in results if isinstance(r, TransferError)]
    if errors:
        metrics.observe_transfer_failure(errors[0].reason)
        raise errors[0]
    return results


@dataclass(frozen=True)
class CorePrefillSetup:
    """What the spawn hands the core to run its Prefill calls (services/engine/core_process.py HandoffsSetup)."""

    host: str  # the worker's advertised host (the gloo pair groups bind there)
    transfer_timeout_s: float
    kv_streaming: bool  # send the KV layer by layer as the last prompt chunk computes
    send_delay_s: float = 0.0  # fault injection for tests: a slow or stuck sender
    metric_labels: Mapping[str, str] = field(default_factory=dict)  # the worker's, on every series

    def __call__(self, engine: Engine, steps: StepLoop, send: Send, registry: CollectorRegistry) -> CorePrefill:
        return CorePrefill(self, engine, steps, send, KVTransferMetrics(self.metric_labels, "prefill", registry))

    def make_sender(self, device: torch.device) -> KVSender:
        """The core's KV sender (tests and benchmarks give their own transport)."""
        return make_sender(self.host, self.transfer_timeout_s, device)


class CorePrefill:
    """The core's Prefill calls (services/engine/core_process.py CoreHandoffs), one task each on their loop."""

    def __init__(
        self, setup: CorePrefillSetup, engine: Engine, steps: StepLoop, send: Send, metrics: KVTransferMetrics
    ) -> None:
        self._steps, self._prompts = steps, CorePrompts(engine)
        port = HandoffPort(steps)
        self._num_kv_heads = port.num_kv_heads
        self._setup, self._send = setup, send
        self._sender = setup.make_sender(port.device)
        self._metrics = metrics
        self._loop = CoreLoop("core-prefills", engine, port.device)
        # follower ranks (children of this core) send their own KV heads from endpoints of their own
        self._loop.run(open_rank_endpoints(port, Endpoint.SENDER, setup.host, setup.transfer_timeout_s))

    def start(self, request: Request, add: cpb.CoreAddRequest) -> None:
        rid = request.request_id
        if not add.HasField("prefill"):
            self._send(refusal(rid, "a prefill worker's engine core hands off no requests", "FAILED_PRECONDITION"))
            return
        try:
            job = job_from_proto(add.prefill, self._num_kv_heads)
        except ValueError as e:  # a plan this worker cannot serve; refused, never a dead reader
            self._send(refusal(rid, f"the Prefill call's KV plan is invalid ({e})", "INVALID_ARGUMENT"))
            return
        self._loop.start_task(rid, lambda: self._prefill(request, job), add.trace_context)

    def on_step(self, step: StepTokens) -> None:
        self._prompts.on_step(step)

    def close(self) -> None:
        async def close() -> None:
            self._sender.close()

        self._loop.close(close)

    # -- on the loop --------------------------------------------------------------------------------
    async def _prefill(self, request: Request, job: HandoffJob) -> None:
        rid, setup, steps, prompts = request.request_id, self._setup, self._steps, self._prompts
        events = prefill_and_send(
            steps, prompts, request, self._sender, job, self._metrics, setup.send_delay_s, setup.kv_streaming
        )
        try:
            async for event in events:
                self._send(cpb.CoreEvent(prefill_event=_prefill_event(rid, event)))
        except asyncio.CancelledError:  # the call is gone: prefill_and_send aborted a prompt still computing
            pass
        except ValueError as e:  # a job this worker cannot serve (layout, heads)
            self._send(refusal(rid, str(e), "INVALID_ARGUMENT"))
        except TransferError as e:
            self._send(refusal(rid, f"KV transfer failed ({e.reason.value}): {e}", "UNAVAILABLE"))
        except RequestFailed as e:  # the step failed for this prompt (its blocks are freed)
            self._send(refusal(rid, str(e), "INTERNAL"))
        except Exception as e:  # a bug: this call ends, the core serves on
            log.exception("request %s: the Prefill call failed", rid)
            self._send(refusal(rid, f"the Prefill call failed ({type(e).__name__}: {e})", "INTERNAL"))


def _prefill_event(request_id: str, event: HandoffEvent) -> cpb.CorePrefillEvent:
    """The event in its wire form, which the serving process streams as it is, and its kind."""
    response = event_to_proto(event).SerializeToString()
    if isinstance(event, FirstToken):
        kind, queue_ms = cpb.CORE_PREFILL_EVENT_KIND_FIRST_TOKEN, event.queue_ms
    else:
        started = isinstance(event, SendStarted)
        kind = cpb.CORE_PREFILL_EVENT_KIND_SEND_STARTED if started else cpb.CORE_PREFILL_EVENT_KIND_TRANSFER_DONE
        queue_ms = 0.0
    return cpb.CorePrefillEvent(request_id=request_id, response=response, kind=kind, queue_ms=queue_ms)
