"""GenerationCore's retries and migrations (gateway/generation.py), with a fake planner and proxy: a
request that fails on a worker before any token went out runs elsewhere, up to MAX_ATTEMPTS plans,
each avoiding every worker blamed so far; once tokens went out, the stream moves to another worker
with what the client already has (a Continuation), up to the migration limit."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc
import pytest

from splitserve.gateway.generation import MAX_ATTEMPTS, GenerationCore, MigrationConfig
from splitserve.gateway.metrics import MIGRATION_OUTCOMES, GatewayMetrics
from splitserve.gateway.proxy import Abort, WorkerFailed
from splitserve.protos.v1 import generation_pb2 as gen_pb
from splitserve.protos.v1 import worker_pb2 as pb


class _Validator:
    def __init__(self, params: pb.EngineSamplingParams | None = None) -> None:
        self.params = params or pb.EngineSamplingParams(temperature=0.0)

    async def worker_request(self, request, request_id):
        return pb.WorkerGenerateRequest(request_id=request_id, prompt_token_ids=[1, 2, 3], params=self.params)


class _Planner:
    """Plans on workers w0, w1, ... in turn, never one in avoid; records what each plan avoided."""

    def __init__(self, num_workers: int) -> None:
        self.workers = [
            SimpleNamespace(address=f"w{i}", worker_id=f"w{i}", role_name="decode") for i in range(num_workers)
        ]
        self.avoided: list[set[str]] = []
        self.asked: list[tuple[list[int], bool]] = []  # (prompt, local) of each plan

    async def plan(self, prompt, avoid, *, retry, migrated=False):
        self.avoided.append(set(avoid))
        self.asked.append((list(prompt), migrated))
        free = [w for w in self.workers if w.address not in avoid]
        return SimpleNamespace(target=SimpleNamespace(worker=free[0]), prefill=None) if free else None


class _Proxy:
    """The first num_failing workers it is sent to fail (after tokens_first tokens "7", text "ab" each);
    the next streams one token. Records each call's request and first-token time."""

    def __init__(self, num_failing: int, tokens_first: int = 0) -> None:
        self.num_failing, self.tokens_first = num_failing, tokens_first
        self.requests: list[pb.WorkerGenerateRequest] = []
        self.first_token_at: list[float | None] = []

    async def stream(self, plan, request, deadline, arrival, first_token_at=None):
        self.requests.append(request)
        self.first_token_at.append(first_token_at)
        worker = plan.target.worker
        if len(self.requests) <= self.num_failing:
            for _ in range(self.tokens_first):
                yield gen_pb.GenerateResponse(token_ids=[7], text="ab")
            raise WorkerFailed(worker, f"{worker.address}: this worker is shutting down")
        yield gen_pb.GenerateResponse(token_ids=[9])


def _run(
    planner: _Planner,
    proxy: _Proxy,
    migration: MigrationConfig | None = None,
    metrics: GatewayMetrics | None = None,
    validator: _Validator | None = None,
) -> list[int]:
    metrics = metrics or GatewayMetrics()
    core = GenerationCore(8, validator or _Validator(), planner, proxy, metrics, migration or MigrationConfig())  # type: ignore[arg-type]

    async def main():
        return [
            t for r in [r async for r in core.generate(gen_pb.GenerateRequest(request_id="r"))] for t in r.token_ids
        ]

    return asyncio.run(main())


def _migrations(metrics: GatewayMetrics) -> dict[str, float]:
    return {
        o: metrics.registry.get_sample_value("splitserve_gateway_migrations_total", {"outcome": o})
        for o in MIGRATION_OUTCOMES
    }


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


def test_a_stream_that_fails_after_tokens_moves_on_with_what_the_client_has():
    planner, proxy, metrics = _Planner(4), _Proxy(num_failing=2, tokens_first=2), GatewayMetrics()
    assert _run(planner, proxy, metrics=metrics) == [7, 7, 7, 7, 9]  # nothing repeated, nothing lost
    # Each move plans one worker for the whole request (no prefill pair), away from the failed ones,
    # routed by the prompt and the tokens so far, and carries them with the text length already sent.
    assert planner.asked == [([1, 2, 3], False), ([1, 2, 3, 7, 7], True), ([1, 2, 3, 7, 7, 7, 7], True)]
    assert planner.avoided == [set(), {"w0"}, {"w0", "w1"}]
    assert not proxy.requests[0].HasField("continuation")
    moved = [r.continuation for r in proxy.requests[1:]]
    assert [list(c.output_token_ids) for c in moved] == [[7, 7], [7, 7, 7, 7]]
    assert [c.num_text_chars for c in moved] == [4, 8]
    assert all(r.prompt_token_ids == [1, 2, 3] and r.prefill_address == "" for r in proxy.requests)
    # Its time to first token stays the stream's.
    assert proxy.first_token_at[0] is None and proxy.first_token_at[1] == proxy.first_token_at[2] is not None
    assert _migrations(metrics) == {"resumed": 2, "limit": 0, "too_long": 0, "no_worker": 0}
    assert metrics.registry.get_sample_value("splitserve_gateway_retries_total", {"role": "decode"}) == 0


def test_a_stream_ends_unavailable_once_its_migrations_are_spent_too_long_or_no_worker_is_left():
    cases = [
        (MigrationConfig(limit=1), _Planner(4), 3, "limit"),
        (MigrationConfig(max_tokens=4), _Planner(4), 1, "too_long"),  # 3 prompt tokens + 2 sent: untracked
        (MigrationConfig(), _Planner(1), 1, "no_worker"),
    ]
    for migration, planner, num_failing, outcome in cases:
        metrics = GatewayMetrics()
        with pytest.raises(Abort) as failed:
            _run(planner, _Proxy(num_failing=num_failing, tokens_first=2), migration, metrics)
        assert failed.value.code == grpc.StatusCode.UNAVAILABLE, outcome
        assert _migrations(metrics)[outcome] == 1, outcome
    off = _Planner(3)
    with pytest.raises(Abort):
        _run(off, _Proxy(num_failing=1, tokens_first=1), MigrationConfig(limit=0))
    assert len(off.avoided) == 1


def test_an_unseeded_sampled_request_gets_a_seed_here_and_a_greedy_one_none():
    seeds = []
    for params in (pb.EngineSamplingParams(), pb.EngineSamplingParams(temperature=0.0)):
        proxy = _Proxy(num_failing=0)
        _run(_Planner(1), proxy, validator=_Validator(params))
        seeds.append(proxy.requests[0].params.seed if proxy.requests[0].params.HasField("seed") else None)
    assert seeds[0] is not None and seeds[1] is None
    kept = _Proxy(num_failing=0)
    _run(_Planner(1), kept, validator=_Validator(pb.EngineSamplingParams(temperature=0.7, seed=2**64 - 1)))
    assert kept.requests[0].params.seed == 2**64 - 1


class _FailsAfterItsEnd(_Proxy):
    """Streams a whole answer (its last response finished), then the call fails (the worker died
    before the call's status reached the gateway)."""

    async def stream(self, plan, request, deadline, arrival, first_token_at=None):
        self.requests.append(request)
        yield gen_pb.GenerateResponse(token_ids=[7])
        yield gen_pb.GenerateResponse(token_ids=[8], finish_reason=gen_pb.FINISH_REASON_STOP)
        raise WorkerFailed(plan.target.worker, "connection reset")


def test_a_stream_whose_worker_fails_after_its_last_response_is_complete_not_moved():
    planner, proxy, metrics = _Planner(3), _FailsAfterItsEnd(num_failing=0), GatewayMetrics()
    assert _run(planner, proxy, metrics=metrics) == [7, 8]  # nothing generated past its stop
    assert len(proxy.requests) == 1 and not any(_migrations(metrics).values())
