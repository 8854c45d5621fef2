"""A request crosses the worker once, typed: the Generate or Prefill call the worker received goes to
its engine core as it came (one schema for sampling parameters, EngineSamplingParams, from the gateway
to the core), and parameters no gateway would have sent are refused before they reach it (a fake
engine core client records what it was given)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from splitserve.common.roles import Role
from splitserve.common.sampling_params import SamplingParams
from splitserve.common.wire import params_from_proto, params_to_proto
from splitserve.protos.v1 import engine_core_pb2 as cpb
from splitserve.protos.v1 import worker_pb2 as pb
from splitserve.protos.v1 import worker_pb2_grpc as pb_grpc
from splitserve.services.engine.engine import RequestOutput
from splitserve.services.worker.metrics import EngineSnapshot, WorkerMetrics
from splitserve.services.worker.servicer import WorkerServicer, add_worker_service


class Aborted(Exception):
    pass


class FakeContext:
    def __init__(self) -> None:
        self.code: grpc.StatusCode | None = None

    def invocation_metadata(self) -> tuple:
        return ()

    def set_trailing_metadata(self, metadata) -> None:
        pass

    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        self.code = code
        raise Aborted(details)


class FakeCore:
    """Records the calls it is handed; streams nothing (a call that ended at once)."""

    def __init__(self) -> None:
        self.calls: list = []

    async def generate_call(self, call, params, request_id=None):
        self.calls.append((call, params))
        return
        yield RequestOutput  # an async generator

    async def prefill(self, call):
        self.calls.append(call)
        for event in PREFILL_EVENTS:
            yield event


# A Prefill call's events as a core sends them: each response already encoded
PREFILL_EVENTS = [
    cpb.CorePrefillEvent(
        response=pb.PrefillResponse(first_token=pb.FirstToken(token_id=7, queue_ms=2.5)).SerializeToString(),
        kind=cpb.CORE_PREFILL_EVENT_KIND_FIRST_TOKEN,
        queue_ms=2.5,
    ),
    cpb.CorePrefillEvent(
        response=pb.PrefillResponse(transfer_done=pb.TransferDone(num_blocks=3)).SerializeToString(),
        kind=cpb.CORE_PREFILL_EVENT_KIND_TRANSFER_DONE,
    ),
]


def _servicer(role: Role) -> tuple[WorkerServicer, FakeCore]:
    core = FakeCore()
    metrics = WorkerMetrics("m", role.value, lambda: EngineSnapshot(0, 0, 0.0, 0, 0, 0))
    return WorkerServicer(core, metrics, role), core  # type: ignore[arg-type]


async def _drain(stream) -> None:
    async for _ in stream:
        pass


@pytest.mark.parametrize("role, prefill_address", [(Role.UNIFIED, ""), (Role.DECODE, "prefill:1")])
def test_a_generate_call_reaches_the_core_as_the_worker_received_it(role, prefill_address):
    servicer, core = _servicer(role)
    params = SamplingParams(temperature=0.7, top_k=5, seed=2**64 - 1, max_tokens=9, stop=["x"], logprobs=2)
    request = pb.WorkerGenerateRequest(
        request_id="client-id", prompt_token_ids=[1, 2, 3], params=params_to_proto(params), priority=3
    )
    request.prefill_address = prefill_address
    sent = request.SerializeToString()
    asyncio.run(_drain(servicer.Generate(request, FakeContext())))
    ((call, parsed),) = core.calls
    assert call is request and call.SerializeToString() == sent  # not rebuilt, not re-encoded
    assert parsed == params  # read once here, for output processing; the seed's full uint64 kept


def test_a_prefill_call_crosses_the_worker_as_received_and_its_events_as_the_core_encoded_them():
    """The call goes to the core as it came; each event goes to the caller as the core's bytes, served
    by a real gRPC server (add_worker_service) and parsed only by the caller."""
    servicer, core = _servicer(Role.PREFILL)
    request = pb.PrefillRequest(
        request=pb.WorkerGenerateRequest(prompt_token_ids=[1, 2], params=params_to_proto(SamplingParams(seed=7))),
        num_skip_blocks=1,
        kv_layout="layout",
    )

    async def call() -> tuple[list, list]:
        direct = [r async for r in servicer.Prefill(request, FakeContext())]
        server = grpc.aio.server()
        add_worker_service(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                served = [r async for r in pb_grpc.WorkerStub(channel).Prefill(request, timeout=10)]
        finally:
            await server.stop(None)
        return direct, served

    direct, served = asyncio.run(call())
    assert core.calls[0] is request and core.calls == [request, request]
    assert direct == [event.response for event in PREFILL_EVENTS]  # bytes, not messages
    assert [r.SerializeToString() for r in served] == [e.response for e in PREFILL_EVENTS]
    assert served[0].first_token.token_id == 7 and served[1].transfer_done.num_blocks == 3


def test_unset_parameters_take_the_engines_defaults():
    """A peer that sends no params (or only some) gets SamplingParams' defaults, up to the context length."""
    assert params_from_proto(pb.EngineSamplingParams()) == SamplingParams(max_tokens=None)
    assert params_from_proto(pb.EngineSamplingParams(max_tokens=4, top_p=0.5)) == SamplingParams(
        max_tokens=4, top_p=0.5
    )


def test_parameters_the_gateway_would_refuse_never_reach_the_core():
    servicer, core = _servicer(Role.UNIFIED)
    request = pb.WorkerGenerateRequest(prompt_token_ids=[1], params=pb.EngineSamplingParams(top_p=1.5))
    context = FakeContext()
    with pytest.raises(Aborted, match="top_p"):
        asyncio.run(_drain(servicer.Generate(request, context)))
    assert context.code is grpc.StatusCode.INVALID_ARGUMENT and core.calls == []
