"""Prefill tier: compute a prompt, hand its first token and KV blocks to a decode worker.

Lifecycle of a request here: waiting -> running (chunked prefill) -> held (finished at its first
token; blocks kept under a lease) -> sent -> released (the whole handoff: disagg/handoff.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

from splitserve.disagg.handoff import FirstToken, HandoffEvent, HandoffJob, TransferDone
from splitserve.disagg.transfer.base import KVSender, TransferError, TransferFailure
from splitserve.engine.async_engine import AsyncEngine
from splitserve.engine.engine import RequestOutput
from splitserve.engine.handoff_port import HandoffPort
from splitserve.engine.kv_cache.block_io import checksum
from splitserve.engine.request import Request
from splitserve.worker.metrics import WorkerMetrics


async def prefill_and_send(
    engine: AsyncEngine,
    request: Request,
    sender: KVSender,
    job: HandoffJob,
    metrics: WorkerMetrics | None = None,
    send_delay_s: float = 0.0,
) -> AsyncIterator[HandoffEvent]:
    """Yield FirstToken, then TransferDone. request comes from HandoffPort.make_prefill_request.
    Raises ValueError for a bad job, TransferError if the send fails. send_delay_s is a
    fault-injection hook for tests (a slow or stuck sender)."""
    port = HandoffPort(engine)
    if job.kv_layout != port.kv_layout:
        raise ValueError(
            f"KV layout mismatch: the decode worker has {job.kv_layout}, this prefill worker "
            f"has {port.kv_layout}; run both tiers with the same model, dtype and --block-size"
        )
    sender.connect(job.channel)  # build the pair's group while the prompt computes
    final = await _run_prompt(engine, request)
    if final.handoff is None:
        raise RuntimeError(f"request {request.request_id} ended without its KV ({final.finish_reason})")
    block_ids = final.handoff.block_ids[job.num_skip_blocks :]
    send = asyncio.create_task(_send(port, sender, job, request.request_id, block_ids, metrics, send_delay_s))
    send.add_done_callback(_consume_error)  # if our caller is gone, nobody else awaits it
    logprobs = final.new_logprobs[0] if final.new_logprobs else None
    yield FirstToken(
        final.new_token_ids[0], logprobs, final.handoff.sampler_state, len(block_ids), final.timings.queue_ms
    )
    yield await asyncio.shield(send)


async def _zero() -> float:
    return 0.0


def _consume_error(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()


async def _run_prompt(engine: AsyncEngine, request: Request) -> RequestOutput:
    final = None
    async for out in engine.generate_request(request):
        final = out
    assert final is not None and final.finished
    return final


async def _send(
    port: HandoffPort,
    sender: KVSender,
    job: HandoffJob,
    request_id: str,
    block_ids: Sequence[int],
    metrics: WorkerMetrics | None,
    send_delay_s: float,
) -> TransferDone:
    if not await port.claim_held(request_id):
        raise TransferError(
            TransferFailure.CLOSED,
            f"the KV of request {request_id} was released before its "
            "send started (its lease expired or it was aborted)",
        )
    staging = port.acquire_staging(len(block_ids))
    sent = False
    try:
        if send_delay_s:
            await asyncio.sleep(send_delay_s)
        blocks = await port.read_held(block_ids, staging.tensor)
        sending = asyncio.ensure_future(sender.send(job.channel, job.tag, blocks) if block_ids else _zero())
        crc = await asyncio.to_thread(checksum, blocks)  # overlaps the send (both only read blocks)
        seconds = await sending
        sent = True
    except TransferError as e:
        if metrics is not None:
            metrics.observe_transfer_failure(e.reason)
        raise
    finally:
        await port.release_held(request_id)
        if sent:  # after a failure gloo may still be reading it: leave it to the garbage collector
            port.release_staging(staging)
    done = TransferDone(len(block_ids), blocks.numel() * blocks.element_size(), crc, seconds)
    if metrics is not None:
        metrics.observe_transfer("sent", done.num_blocks, done.num_bytes, seconds)
    return done
