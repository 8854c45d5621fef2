"""A decode worker's KV handoffs inside its engine core process (`--mode decode --engine-process`).

The serving process keeps the per-stream work (the gRPC streams, detokenization, stop strings); the
core steps and, on a thread of its own with an asyncio loop, runs each request's handoff exactly as
a decode worker in one process does (disagg/decode.py DecodeHandoff.hand_off: reserve, the Prefill
RPC, the KV receives into the reserved blocks, the first token, the landing), so the KV never
leaves the process that owns the cache. The first token goes to the serving process like a step's
tokens; the request joins the batch once its KV landed and streams from then on like any other.

What crosses the pipe (engine/core_process.py): an add carrying a CoreHandoff (the prefill worker's
address and the request as received, forwarded as it is); an abort, which cancels a handoff still
in flight (whatever the prefill worker announced is still received and dropped) and aborts the
request in the engine; a refusal with a status code and the prefill worker to blame when the
handoff cannot start (RESOURCE_EXHAUSTED: no room for the prompt's KV; UNAVAILABLE: the prefill
worker failed before the first token), which the serving process returns to the gateway as it
would its own HandoffError.

The handoff's metrics and times cross the pipe too (CoreHandoffObservation, counted by the serving
process's WorkerMetrics; CoreHandoffStages, for the request's stage timings). Not carried over yet:
its spans (the core exports no traces), and tensor-parallel decode workers (refused at start).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from google.protobuf.message import DecodeError

from splitserve.common.security import ClusterSecurity
from splitserve.disagg.decode import DecodeHandoff
from splitserve.disagg.handoff import HandoffError
from splitserve.disagg.prefill_client import GrpcPrefillClient
from splitserve.disagg.transfer.base import TransferFailure
from splitserve.disagg.transfer.torch_dist import TorchDistReceiver
from splitserve.engine.core_process import Send
from splitserve.engine.engine import Engine
from splitserve.engine.handoff_port import HandoffPort
from splitserve.engine.outputs import StageClock
from splitserve.engine.request import Request
from splitserve.engine.step_loop import StepLoop
from splitserve.engine.streams import answer_call
from splitserve.protos.v1 import engine_core_pb2 as cpb
from splitserve.protos.v1 import worker_pb2 as pb

log = logging.getLogger("splitserve.decode")

T = TypeVar("T")


@dataclass(frozen=True)
class CoreDecodeSetup:
    """What the spawn hands the core to make its handoffs (engine/core_process.py HandoffsSetup)."""

    host: str  # where the KV receiver's TCPStore listens (the worker's advertised host)
    transfer_timeout_s: float
    reserve_timeout_s: float
    cluster: ClusterSecurity  # the Prefill RPC's credentials

    def __call__(self, engine: Engine, steps: StepLoop, send: Send) -> CoreDecode:
        return CoreDecode(self, engine, steps, send)


class CoreFront:
    """The core's step loop as a HandoffPort drives it (engine/handoff_port.py EngineFront): calls
    between steps, answered on the handoff thread's event loop."""

    outputs_here = False  # the first token's output is made in the serving process

    def __init__(self, engine: Engine, steps: StepLoop) -> None:
        self.engine, self._steps = engine, steps

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._steps.post(answer_call, loop, future, fn, args)
        return await future

    def post(self, fn: Callable[..., Any], *args: Any) -> None:
        self._steps.post(fn, *args)


class CoreDecode:
    """The core's handoffs (engine/core_process.py CoreHandoffs), one task each on the handoff loop."""

    def __init__(self, setup: CoreDecodeSetup, engine: Engine, steps: StepLoop, send: Send) -> None:
        front = CoreFront(engine, steps)
        if HandoffPort(front).tensor_parallel_size != 1:
            raise ValueError("--engine-process on a decode worker runs one rank only (drop --tensor-parallel-size)")
        self._engine, self._steps, self._send = engine, steps, send
        self._loop = asyncio.new_event_loop()
        self._tasks: dict[str, asyncio.Task] = {}  # handoffs before their first token, on the loop only
        self._thread = threading.Thread(target=self._loop.run_forever, name="core-handoffs", daemon=True)
        self._thread.start()
        make = asyncio.run_coroutine_threadsafe(self._make_handoff(setup, front), self._loop)
        self._handoff, self._client = make.result()

    async def _make_handoff(self, setup: CoreDecodeSetup, front: CoreFront) -> tuple[DecodeHandoff, GrpcPrefillClient]:
        receiver = TorchDistReceiver(setup.host, setup.transfer_timeout_s)
        log.info("KV channels meet at TCPStore %s (in the engine core)", receiver.address)
        client = GrpcPrefillClient(setup.cluster.worker_channel)
        timeouts = (setup.reserve_timeout_s, setup.transfer_timeout_s)
        return DecodeHandoff(front, receiver, client, ObservationRelay(self._send), *timeouts), client

    def start(self, request: Request, handoff: cpb.CoreHandoff) -> None:
        try:
            wire = pb.WorkerGenerateRequest.FromString(handoff.wire)
        except DecodeError as e:  # never from our own serving process; refused, never a dead reader
            self._refuse(request.request_id, f"the forwarded request does not parse ({e})", "INVALID_ARGUMENT")
            return
        self._loop.call_soon_threadsafe(self._start, request, handoff.prefill_address, wire)

    def abort(self, request_id: str) -> None:
        self._loop.call_soon_threadsafe(self._cancel, request_id)

    def close(self) -> None:
        async def stop() -> None:
            for task in list(self._tasks.values()):
                task.cancel()
            self._handoff.receiver.close()
            await self._client.close()

        try:
            asyncio.run_coroutine_threadsafe(stop(), self._loop).result(timeout=5.0)
        except Exception:  # the core is exiting either way
            log.exception("closing the core's handoffs failed")
        self._loop.call_soon_threadsafe(self._loop.stop)

    # -- on the handoff loop ------------------------------------------------------------------------
    def _start(self, request: Request, peer: str, wire: pb.WorkerGenerateRequest) -> None:
        rid = request.request_id
        task = self._loop.create_task(self._hand_off(request, peer, wire))
        self._tasks[rid] = task
        task.add_done_callback(lambda _: self._tasks.pop(rid, None))

    def _cancel(self, request_id: str) -> None:
        task = self._tasks.get(request_id)
        if task is not None:
            task.cancel()

    async def _hand_off(self, request: Request, peer: str, wire: pb.WorkerGenerateRequest) -> None:
        rid = request.request_id
        try:
            _, _, landing = await self._handoff.hand_off(request, peer, wire, lambda clock: self._stages(rid, clock))
            landing.add_done_callback(lambda task: self._landed(rid, task))
        except HandoffError as e:
            self._end(rid)
            self._refuse(rid, e.message, e.code.name, e.failed_peer or "")
        except asyncio.CancelledError:  # aborted by the serving process (its stream is gone)
            self._end(rid)
        except Exception as e:  # a bug: this request ends, the core serves on
            log.exception("request %s: the handoff failed", rid)
            self._end(rid)
            self._refuse(rid, f"the KV handoff failed ({type(e).__name__}: {e})", "INTERNAL")

    def _refuse(self, request_id: str, message: str, code: str, failed_peer: str = "") -> None:
        refusal = cpb.CoreRefusal(request_id=request_id, error=message, code=code, failed_peer=failed_peer)
        self._send(cpb.CoreEvent(refused=refusal))

    def _stages(self, request_id: str, clock: StageClock) -> None:
        """Before the first token goes out: the prefill worker's times, for the request's stage timings."""
        stages = cpb.CoreHandoffStages(
            request_id=request_id,
            prefill_queue_ms=clock.prefill_queue_ms,
            prefill_compute_ms=clock.prefill_compute_ms,
            first_token_time=clock.first_token_at,
        )
        self._send(cpb.CoreEvent(handoff_stages=stages))

    def _landed(self, request_id: str, landing: asyncio.Task[float]) -> None:
        if not landing.cancelled() and landing.exception() is None:
            stages = cpb.CoreHandoffStages(request_id=request_id, landed_time=landing.result())
            self._send(cpb.CoreEvent(handoff_stages=stages))

    def _end(self, request_id: str) -> None:
        """The handoff ended before the first token: whatever it reserved goes (an abort between steps,
        after the reserve if that came first; a no-op if nothing was reserved)."""
        self._steps.post(self._engine.abort_request, request_id)


class ObservationRelay:
    """The handoff's metrics (disagg/decode.py HandoffMetrics), sent to the serving process, whose
    WorkerMetrics counts them (worker/metrics.py observe_core)."""

    def __init__(self, send: Send) -> None:
        self._send = send

    def _observed(self, kind: cpb.CoreObservationKind, **fields: Any) -> None:
        self._send(cpb.CoreEvent(observed=cpb.CoreHandoffObservation(kind=kind, **fields)))

    def observe_blocks_skipped(self, num_blocks: int) -> None:
        self._observed(cpb.CORE_OBSERVATION_KIND_BLOCKS_SKIPPED, num_blocks=num_blocks)

    def observe_transfer(self, direction: str, num_blocks: int, num_bytes: int, seconds: float) -> None:
        fields = dict(direction=direction, num_blocks=num_blocks, num_bytes=num_bytes, seconds=seconds)
        self._observed(cpb.CORE_OBSERVATION_KIND_TRANSFER, **fields)

    def observe_transfer_failure(self, reason: TransferFailure) -> None:
        self._observed(cpb.CORE_OBSERVATION_KIND_TRANSFER_FAILURE, reason=reason.value)

    def observe_rank_bytes(self, direction: str, rank: int, num_bytes: int) -> None:
        self._observed(cpb.CORE_OBSERVATION_KIND_RANK_BYTES, direction=direction, rank=rank, num_bytes=num_bytes)

    def observe_recompute_fallback(self) -> None:
        self._observed(cpb.CORE_OBSERVATION_KIND_RECOMPUTE_FALLBACK)
