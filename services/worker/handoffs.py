"""A prefill or decode worker's KV handoffs, as its servicer calls them: in this process (the engine
with a KV sender, or DecodeHandoff; --no-engine-process) or in the worker's engine core, which runs
them itself (services/disagg/core_prefill.py, services/disagg/core_decode.py). A unified worker has none."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from splitserve.common.sampling_params import SamplingParams
from splitserve.protos.v1 import engine_core_pb2 as cpb
from splitserve.protos.v1 import worker_pb2 as pb
from splitserve.services.disagg.decode import DecodeHandoff
from splitserve.services.disagg.prefill import prefill_and_send
from splitserve.services.disagg.prefill_client import event_to_proto, job_from_proto
from splitserve.services.disagg.transfer.base import KVSender
from splitserve.services.engine.async_engine import AsyncEngine
from splitserve.services.engine.core_client import EngineCoreClient
from splitserve.services.engine.engine import RequestOutput
from splitserve.services.engine.handoff_port import HandoffPort
from splitserve.services.worker.metrics import WorkerMetrics


class WorkerHandoffs(Protocol):
    def decode(
        self, prompt: list[int], params: SamplingParams, call: pb.WorkerGenerateRequest
    ) -> AsyncIterator[RequestOutput]:
        """A decode worker's request: its prompt's KV from call.prefill_address, then decoded here.
        The client's id is a label only (the engine names the request)."""
        ...

    def prefill(self, call: pb.PrefillRequest, params: SamplingParams) -> AsyncIterator[pb.PrefillResponse]:
        """A prefill worker's Prefill call: its events as the call streams them."""
        ...

    def landing(self) -> bool:
        """KV still landing that the engine's load does not count (a drain waits for it)."""
        ...

    def close(self) -> None:
        """Release the KV endpoints, once the worker has drained."""
        ...


class HandoffsInCore:
    """The engine core runs the handoffs; its load counts what is landing."""

    def __init__(self, client: EngineCoreClient) -> None:
        self.client = client

    def decode(
        self, prompt: list[int], params: SamplingParams, call: pb.WorkerGenerateRequest
    ) -> AsyncIterator[RequestOutput]:
        handoff = cpb.CoreHandoff(prefill_address=call.prefill_address, wire=call.SerializeToString())
        return self.client.generate(prompt, params, priority=call.priority, label=call.request_id, handoff=handoff)

    def prefill(self, call: pb.PrefillRequest, params: SamplingParams) -> AsyncIterator[pb.PrefillResponse]:
        return self.client.prefill(list(call.request.prompt_token_ids), params, call)

    def landing(self) -> bool:
        return False

    def close(self) -> None:
        pass  # the core closes its endpoints as it exits


class HandoffsInProcess:
    """The engine in this process: a prefill worker's KV sender, or a decode worker's DecodeHandoff."""

    def __init__(
        self,
        engine: AsyncEngine,
        metrics: WorkerMetrics | None = None,
        sender: KVSender | None = None,
        handoff: DecodeHandoff | None = None,
        send_delay_s: float = 0.0,
        kv_streaming: bool = False,
    ) -> None:
        self.engine, self.metrics, self.port = engine, metrics, HandoffPort(engine)
        self.sender, self.handoff = sender, handoff
        self.send_delay_s = send_delay_s  # fault injection for tests: a slow prefill-side send
        self.kv_streaming = kv_streaming  # prefill: KV sent layer by layer as computed (services/disagg/handoff.py)

    def decode(
        self, prompt: list[int], params: SamplingParams, call: pb.WorkerGenerateRequest
    ) -> AsyncIterator[RequestOutput]:
        assert self.handoff is not None, "a decode worker's (the servicer checks the role)"
        request = self.engine.make_request(prompt, params, priority=call.priority, label=call.request_id)
        return self.handoff.generate(request, call.prefill_address, wire=call)

    def prefill(self, call: pb.PrefillRequest, params: SamplingParams) -> AsyncIterator[pb.PrefillResponse]:
        assert self.sender is not None, "a prefill worker's (the servicer checks the role)"
        r = call.request
        job = job_from_proto(call, self.port.num_kv_heads)
        request = self.port.make_prefill_request(list(r.prompt_token_ids), params, r.priority, r.request_id)
        events = prefill_and_send(
            self.engine, request, self.sender, job, self.metrics, self.send_delay_s, self.kv_streaming
        )
        return (event_to_proto(event) async for event in events)

    def landing(self) -> bool:
        return self.handoff is not None and bool(self.handoff.landings)

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
        if self.handoff is not None:
            self.handoff.receiver.close()
