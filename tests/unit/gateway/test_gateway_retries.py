"""GenerationCore's retries (gateway/generation.py), with a fake planner and proxy: a request that fails
on a worker before any token went out runs elsewhere, up to MAX_ATTEMPTS plans, each avoiding every
worker blamed so far; once a token went out a failure ends it."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc
import pytest

from splitserve.gateway.generation import MAX_ATTEMPTS, GenerationCore
from splitserve.gateway.metrics import GatewayMetrics
from splitserve.gateway.proxy import Abort, WorkerFailed
from splitserve.protos.v1 import generation_pb2 as gen_pb
from splitserve.protos.v1 import worker_pb2 as pb


class _Validator:
    async def worker_request(self, request, request_id):
        return pb.WorkerGenerateRequest(request_id=request_id, prompt_token_ids=[1, 2, 3])


class _Planner:
    """Plans on workers w0, w1, ... in turn, never one in avoid; records what each plan avoided."""

    def __init__(self, num_workers: int) -> None:
        self.workers = [
            SimpleNamespace(address=f"w{i}", worker_id=f"w{i}", role_name="decode") for i in range(num_workers)
        ]
        self.avoided: list[set[str]] = []

    async def plan(self, prompt, avoid, *, retry):
        self.avoided.append(set(avoid))
        free = [w for w in self.workers if w.address not in avoid]
        return SimpleNamespace(target=SimpleNamespace(worker=free[0]), prefill=None) if free else None


class _Proxy:
    """The first num_failing workers it is sent to fail (after tokens_first tokens); the next streams one token."""

    def __init__(self, num_failing: int, tokens_first: int = 0) -> None:
        self.num_failing, self.tokens_first, self.calls = num_failing, tokens_first, 0

    async def stream(self, plan, request, deadline, arrival):
        self.calls += 1
        worker = plan.target.worker
        if self.calls <= self.num_failing:
            for _ in range(self.tokens_first):
                yield gen_pb.GenerateResponse(token_ids=[7])
            raise WorkerFailed(worker, f"{worker.address}: this worker is shutting down")
        yield gen_pb.GenerateResponse(token_ids=[9])


def _run(planner: _Planner, proxy: _Proxy) -> list[int]:
    core = GenerationCore(8, _Validator(), planner, proxy, GatewayMetrics())  # type: ignore[arg-type]

    async def main():
        return [
            t for r in [r async for r in core.generate(gen_pb.GenerateRequest(request_id="r"))] for t in r.token_ids
        ]

    return asyncio.run(main())


def test_failures_before_the_first_token_run_elsewhere_avoiding_every_worker_blamed():
    """Two workers draining at once (each refuses: shutting down) cost a request nothing."""
    planner, proxy = _Planner(4), _Proxy(num_failing=MAX_ATTEMPTS - 1)
    assert _run(planner, proxy) == [9]
    assert planner.avoided == [{f"w{i}" for i in range(n)} for n in range(MAX_ATTEMPTS)]


def test_a_request_fails_once_its_attempts_are_spent_or_no_worker_is_left():
    with pytest.raises(Abort) as spent:
        _run(_Planner(MAX_ATTEMPTS + 1), _Proxy(num_failing=MAX_ATTEMPTS))
    assert spent.value.code == grpc.StatusCode.UNAVAILABLE and "shutting down" in spent.value.message
    with pytest.raises(Abort) as none_left:
        _run(_Planner(1), _Proxy(num_failing=1))
    assert none_left.value.code == grpc.StatusCode.UNAVAILABLE


def test_a_failure_after_a_token_went_out_is_not_retried():
    planner = _Planner(3)
    with pytest.raises(Abort):
        _run(planner, _Proxy(num_failing=1, tokens_first=1))
    assert len(planner.avoided) == 1
