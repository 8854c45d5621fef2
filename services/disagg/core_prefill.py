"""A prefill worker's Prefill calls inside its engine core process (`--mode prefill`).

The serving process keeps the gRPC call; the core computes the prompt and sends its KV from the
process that owns the cache, running what a prefill worker in one process runs
(services/disagg/prefill.py prefill_and_send: the pair groups built while the prompt computes, the send
streamed layer by layer from the step computing the prompt's last chunk, the held blocks released
once sent) on a thread of its own with an asyncio loop. The prompt's first token is processed in
the core (services/disagg/core_handoffs.py CorePrompts, fed each step's tokens before they leave): a prompt
ends at its first token, and what the call streams is that token, not text.

What crosses the pipe (services/engine/core_process.py): an add carrying a CorePrefill (the call as
received); each event of the call as it streams it (CorePrefillEvent: SendStarted, FirstToken,
TransferDone, serialized PrefillResponses); a failure as a refusal with its status code
(INVALID_ARGUMENT: a job this worker cannot serve; UNAVAILABLE: the send failed; INTERNAL: the step
failed for it), which the serving process ends the call with, as it would in one process; an abort
(the call is gone), which aborts a prompt still computing and ends its send (one still waiting to
join its channel ends at once; bytes already moving finish first), releasing its blocks, as in one
process. The send's metrics are relayed (ObservationRelay).

Its spans join the request's trace (services/disagg/core_handoffs.py). A tensor-parallel prefill worker's
follower ranks are the core's children: the core opens their KV endpoints and orders their sends
(streamed ones from the step loop, before the step reaches them), as a serving process does in one
process.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from google.protobuf.message import DecodeError

from splitserve.protos.v1 import engine_core_pb2 as cpb
from splitserve.protos.v1 import worker_pb2 as pb
from splitserve.services.disagg.core_handoffs import CoreFront, CoreLoop, CorePrompts, ObservationRelay, open_endpoints
from splitserve.services.disagg.handoff import HandoffJob
from splitserve.services.disagg.prefill import prefill_and_send
from splitserve.services.disagg.prefill_client import event_to_proto, job_from_proto
from splitserve.services.disagg.rank_transfers import Endpoint
from splitserve.services.disagg.transfer.base import TransferError
from splitserve.services.disagg.transfer.isolated import make_sender
from splitserve.services.engine.core_process import Send, refusal
from splitserve.services.engine.engine import Engine
from splitserve.services.engine.handoff_port import HandoffPort
from splitserve.services.engine.outputs import StepTokens
from splitserve.services.engine.request import Request
from splitserve.services.engine.step_loop import StepLoop
from splitserve.services.engine.streams import RequestFailed

log = logging.getLogger("splitserve.prefill")


@dataclass(frozen=True)
class CorePrefillSetup:
    """What the spawn hands the core to run its Prefill calls (services/engine/core_process.py HandoffsSetup)."""

    host: str  # the worker's advertised host (the gloo pair groups bind there)
    transfer_timeout_s: float
    kv_streaming: bool  # send the KV layer by layer as the last prompt chunk computes
    send_delay_s: float = 0.0  # fault injection for tests: a slow or stuck sender

    def __call__(self, engine: Engine, steps: StepLoop, send: Send) -> CorePrefill:
        return CorePrefill(self, engine, steps, send)


class CorePrefill:
    """The core's Prefill calls (services/engine/core_process.py CoreHandoffs), one task each on their loop."""

    def __init__(self, setup: CorePrefillSetup, engine: Engine, steps: StepLoop, send: Send) -> None:
        self._prompts = CorePrompts(engine)
        self._front = CoreFront(engine, steps, self._prompts)
        port = HandoffPort(self._front)
        self._num_kv_heads = port.num_kv_heads
        self._setup, self._send = setup, send
        self._sender = make_sender(setup.host, setup.transfer_timeout_s, port.device)
        self._relay = ObservationRelay(send)
        self._loop = CoreLoop("core-prefills", port.device)
        # follower ranks (children of this core) send their own KV heads from endpoints of their own
        self._loop.run(open_endpoints(port, Endpoint.SENDER, setup.host, setup.transfer_timeout_s))

    def start(self, request: Request, add: cpb.CoreAddRequest) -> None:
        rid = request.request_id
        if not add.HasField("prefill"):
            self._send(refusal(rid, "a prefill worker's engine core hands off no requests", "FAILED_PRECONDITION"))
            return
        try:
            job = job_from_proto(pb.PrefillRequest.FromString(add.prefill.wire), self._num_kv_heads)
        except (DecodeError, ValueError) as e:  # never from our own serving process; refused, never a dead reader
            self._send(refusal(rid, f"the Prefill call does not parse ({e})", "INVALID_ARGUMENT"))
            return
        self._loop.start_task(rid, lambda: self._prefill(request, job), add.trace_context)

    def abort(self, request_id: str) -> None:
        self._loop.cancel(request_id)

    def on_step(self, step: StepTokens) -> None:
        self._prompts.on_step(step)

    def close(self) -> None:
        async def close() -> None:
            self._sender.close()

        self._loop.close(close)

    # -- on the loop --------------------------------------------------------------------------------
    async def _prefill(self, request: Request, job: HandoffJob) -> None:
        rid, setup = request.request_id, self._setup
        events = prefill_and_send(
            self._front, request, self._sender, job, self._relay, setup.send_delay_s, setup.kv_streaming
        )
        try:
            async for event in events:
                wire = event_to_proto(event).SerializeToString()
                self._send(cpb.CoreEvent(prefill_event=cpb.CorePrefillEvent(request_id=rid, response=wire)))
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
