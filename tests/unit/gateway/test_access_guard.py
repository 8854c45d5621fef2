"""The access guard on a real grpc.aio server: a public call holds its key's concurrency slot only
while its handler runs, so a call that never reaches the handler (a request message that does not
parse, a client that half-closes without one) cannot keep the slot."""

from __future__ import annotations

import asyncio

import grpc

from splitserve.common.security import AccessGuard, ClusterSecurity
from splitserve.gateway.auth import ApiKeys, KeyLimiter, KeyPolicy, PublicAccess
from splitserve.protos.v1 import generation_pb2 as gen_pb
from splitserve.protos.v1 import generation_pb2_grpc as gen_grpc

_GENERATE = "/splitserve.v1.Generation/Generate"
_KEY = (("authorization", "Bearer sk-one"),)


class _OneToken(gen_grpc.GenerationServicer):
    async def Generate(self, request, context):  # noqa: N802  # the proto's name
        yield gen_pb.GenerateResponse(request_id=request.request_id)


async def _serve(access: PublicAccess, denied: list | None = None) -> tuple[grpc.aio.Server, str]:
    guard = AccessGuard(ClusterSecurity(), (), access)
    if denied is not None:
        guard.on_denied = lambda kind, code: denied.append((kind, code))
    server = grpc.aio.server(interceptors=[guard])
    gen_grpc.add_GenerationServicer_to_server(_OneToken(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


async def _status(call) -> grpc.StatusCode:
    try:
        async for _ in call:
            pass
    except grpc.aio.AioRpcError as e:
        return e.code()
    return await call.code()


async def _calls_that_never_reach_the_handler(address: str) -> list[grpc.StatusCode]:
    async with grpc.aio.insecure_channel(address) as channel:
        garbage = channel.unary_stream(_GENERATE, request_serializer=lambda b: b)
        no_message = channel.stream_stream(_GENERATE, request_serializer=lambda b: b)
        unparsable = garbage(b"\xff\xff\xff\xff", metadata=_KEY, timeout=30)  # not a GenerateRequest
        # half-closes without a request message: the server waits for one until the deadline
        half_closed = no_message(iter(()), metadata=_KEY, timeout=1)
        return [await _status(unparsable), await _status(half_closed)]


async def _valid_call(address: str) -> grpc.StatusCode:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = gen_grpc.GenerationStub(channel)
        call = stub.Generate(gen_pb.GenerateRequest(request_id="ok", text="hi"), metadata=_KEY, timeout=30)
        return await _status(call)


def test_calls_that_never_reach_the_handler_do_not_keep_a_concurrency_slot(monkeypatch):
    monkeypatch.setenv("SPLITSERVE_API_KEYS", "sk-one")
    keys = ApiKeys.load(None, KeyPolicy(concurrency=2))
    assert keys is not None
    limiter = KeyLimiter()
    policy = keys.lookup(_KEY)
    assert policy is not None

    async def run() -> tuple[list[grpc.StatusCode], int, list[grpc.StatusCode]]:
        server, address = await _serve(PublicAccess(keys, limiter))
        try:
            failed = await _calls_that_never_reach_the_handler(address)
            held = limiter.in_flight(policy.name)
            valid = [await _valid_call(address) for _ in range(3)]  # with concurrency 2: would be refused
            return failed, held, valid
        finally:
            await server.stop(None)

    failed, held, valid = asyncio.run(run())
    assert grpc.StatusCode.OK not in failed  # both calls failed in gRPC, before any handler
    assert held == 0
    assert valid == [grpc.StatusCode.OK] * 3
    assert limiter.in_flight(policy.name) == 0


def test_a_wrong_key_is_refused_and_counted_and_takes_no_slot(monkeypatch):
    monkeypatch.setenv("SPLITSERVE_API_KEYS", "sk-one")
    keys = ApiKeys.load(None, KeyPolicy(concurrency=1))
    assert keys is not None
    limiter, denied = KeyLimiter(), []

    async def run() -> grpc.StatusCode:
        server, address = await _serve(PublicAccess(keys, limiter), denied)
        try:
            async with grpc.aio.insecure_channel(address) as channel:
                call = gen_grpc.GenerationStub(channel).Generate(
                    gen_pb.GenerateRequest(text="hi"), metadata=(("authorization", "Bearer sk-two"),), timeout=30
                )
                return await _status(call)
        finally:
            await server.stop(None)

    assert asyncio.run(run()) is grpc.StatusCode.UNAUTHENTICATED
    assert denied == [("public", grpc.StatusCode.UNAUTHENTICATED)]
    assert limiter.in_flight("key-1") == 0
