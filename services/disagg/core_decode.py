"""A decode worker's KV handoffs inside its engine core process (`--mode decode`).

The serving process keeps the per-stream work (the gRPC streams, detokenization, stop strings); the
core steps and, on a thread of its own with an asyncio loop, runs each request's handoff exactly as
a decode worker in one process does (services/disagg/decode.py DecodeHandoff.hand_off: reserve, the Prefill
RPC, the KV receives into the reserved blocks, the first token, the landing), so the KV never
leaves the process that owns the cache. The first token goes to the serving process like a step's
tokens; the request joins the batch once its KV landed and streams from then on like any other.

What crosses the pipe (services/engine/core_process.py): an add carrying a CoreHandoff (the prefill worker's
address and the request as received, forwarded as it is); an abort, which cancels a handoff still
in flight (whatever the prefill worker announced is still received and dropped) and aborts the
request in the engine; a refusal with a status code and the prefill worker to blame when the
handoff cannot start (RESOURCE_EXHAUSTED: no room for the prompt's KV; UNAVAILABLE: the prefill
worker failed before the first token), which the serving process returns to the gateway as it
would its own HandoffError.

The handoff's metrics and times cross the pipe too (CoreHandoffObservation, counted by the serving
process's WorkerMetrics; CoreHandoffStages, for the request's stage timings), and its spans join the
request's trace (services/disagg/core_handoffs.py, which also holds the thread, the step loop's front and the
metrics relay). A tensor-parallel decode worker's follower ranks are the core's children: the core
opens their KV endpoints and orders their receives, as a serving process does in one process.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from google.protobuf.message import DecodeError

from splitserve.common.security import ClusterSecurity
from splitserve.protos.v1 import engine_core_pb2 as cpb
from splitserve.protos.v1 import worker_pb2 as pb
from splitserve.services.disagg.core_handoffs import CoreFront, CoreLoop, ObservationRelay, open_endpoints
from splitserve.services.disagg.decode import DecodeHandoff
from splitserve.services.disagg.handoff import HandoffError
from splitserve.services.disagg.prefill_client import GrpcPrefillClient
from splitserve.services.disagg.rank_transfers import Endpoint
from splitserve.services.disagg.transfer.isolated import make_receiver
from splitserve.services.engine.core_process import Send, refusal
from splitserve.services.engine.engine import Engine
from splitserve.services.engine.handoff_port import HandoffPort
from splitserve.services.engine.outputs import StageClock, StepTokens
from splitserve.services.engine.request import Request
from splitserve.services.engine.step_loop import StepLoop

log = logging.getLogger("splitserve.decode")


@dataclass(frozen=True)
class CoreDecodeSetup:
    """What the spawn hands the core to make its handoffs (services/engine/core_process.py HandoffsSetup)."""

    host: str  # where the KV receiver's TCPStore listens (the worker's advertised host)
    transfer_timeout_s: float
    reserve_timeout_s: float
    cluster: ClusterSecurity  # the Prefill RPC's credentials

    def __call__(self, engine: Engine, steps: StepLoop, send: Send) -> CoreDecode:
        return CoreDecode(self, engine, steps, send)


class CoreDecode:
    """The core's handoffs (services/engine/core_process.py CoreHandoffs), one task each on the handoff loop."""

    def __init__(self, setup: CoreDecodeSetup, engine: Engine, steps: StepLoop, send: Send) -> None:
        self._front = CoreFront(engine, steps)
        self._send = send
        self._loop = CoreLoop("core-handoffs", HandoffPort(self._front).device)
        self._handoff, self._client = self._loop.run(self._make_handoff(setup))

    async def _make_handoff(self, setup: CoreDecodeSetup) -> tuple[DecodeHandoff, GrpcPrefillClient]:
        receiver = make_receiver(setup.host, setup.transfer_timeout_s, HandoffPort(self._front).device)
        log.info("KV channels meet at TCPStore %s (in the engine core)", receiver.address)
        # follower ranks (children of this core) receive their own KV heads on endpoints of their own
        await open_endpoints(HandoffPort(self._front), Endpoint.RECEIVER, setup.host, setup.transfer_timeout_s)
        client = GrpcPrefillClient(setup.cluster.worker_channel)
        timeouts = (setup.reserve_timeout_s, setup.transfer_timeout_s)
        return DecodeHandoff(self._front, receiver, client, ObservationRelay(self._send), *timeouts), client

    def start(self, request: Request, add: cpb.CoreAddRequest) -> None:
        rid = request.request_id
        if not add.HasField("handoff"):
            self._send(refusal(rid, "a decode worker's engine core runs no Prefill calls", "FAILED_PRECONDITION"))
            return
        try:
            wire = pb.WorkerGenerateRequest.FromString(add.handoff.wire)
        except DecodeError as e:  # never from our own serving process; refused, never a dead reader
            self._send(refusal(rid, f"the forwarded request does not parse ({e})", "INVALID_ARGUMENT"))
            return
        peer = add.handoff.prefill_address
        self._loop.start_task(rid, lambda: self._hand_off(request, peer, wire), add.trace_context)

    def abort(self, request_id: str) -> None:
        self._loop.cancel(request_id)

    def on_step(self, step: StepTokens) -> None:
        pass  # every output of a decode worker is made in its serving process

    def close(self) -> None:
        async def close() -> None:
            self._handoff.receiver.close()
            await self._client.close()

        self._loop.close(close)

    # -- on the handoff loop ------------------------------------------------------------------------
    async def _hand_off(self, request: Request, peer: str, wire: pb.WorkerGenerateRequest) -> None:
        rid = request.request_id
        try:
            _, _, landing = await self._handoff.hand_off(request, peer, wire, lambda clock: self._stages(rid, clock))
            landing.add_done_callback(lambda task: self._landed(rid, task))
        except HandoffError as e:
            self._end(rid)
            self._send(refusal(rid, e.message, e.code.name, e.failed_peer or ""))
        except asyncio.CancelledError:  # aborted by the serving process (its stream is gone)
            self._end(rid)
        except Exception as e:  # a bug: this request ends, the core serves on
            log.exception("request %s: the handoff failed", rid)
            self._end(rid)
            self._send(refusal(rid, f"the KV handoff failed ({type(e).__name__}: {e})", "INTERNAL"))

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
        self._front.post(self._front.engine.abort_request, request_id)
