"""KV-aware routing on hand-made worker states: prefix hits win, load spreads, no pile-up, decode
prefers free KV, and without the index it routes by load."""

from __future__ import annotations

from collections import Counter

from splitserve.common.roles import Role
from splitserve.gateway.router import SPREAD_MARGIN, RouteInput, make_router
from splitserve.gateway.workers import WorkerHandle, WorkerSet
from splitserve.protos.v1 import worker_pb2 as pb


def _worker(address: str, outstanding: int = 0, free: int = 100, total: int = 100) -> WorkerHandle:
    return WorkerHandle(
        worker_id=address,
        address=address,
        role=Role.PREFILL,
        model="m",
        max_model_len=1024,
        metrics_address="",
        block_size=16,
        channel=None,
        stub=None,
        outstanding=outstanding,
        load=pb.LoadReport(num_free_blocks=free, num_total_blocks=total, block_size=16),
    )


def _route(matched: dict[str, int] | None, num_blocks: int = 10) -> RouteInput:
    return RouteInput(list(range(num_blocks * 16)), num_blocks, matched)


def test_prefill_prefers_the_worker_holding_the_prefix():
    router = make_router("kv-aware")
    workers = [_worker("a"), _worker("b", outstanding=2), _worker("c")]
    for _ in range(5):  # whatever the rotation
        decision = router.pick(workers, _route({"a": 0, "b": 9, "c": 1}), "prefill")
        assert decision.worker.address == "b" and decision.reason == "prefix_hit"


def test_prefill_spreads_when_the_cache_affine_worker_is_overloaded():
    router = make_router("kv-aware")
    busy, idle = _worker("a", outstanding=SPREAD_MARGIN + 1), _worker("b", outstanding=0)
    decision = router.pick([busy, idle], _route({"a": 10, "b": 0}), "prefill")
    assert decision.worker is idle and decision.reason == "spread"
    busy.outstanding = SPREAD_MARGIN - 2  # close enough: the hit still wins
    assert router.pick([busy, idle], _route({"a": 10, "b": 0}), "prefill").worker is busy


def test_equal_workers_share_the_load_and_no_index_means_load_only():
    router = make_router("kv-aware")
    workers = [_worker(x) for x in "abcd"]
    picks = Counter(router.pick(workers, _route({x: 0 for x in "abcd"}), "prefill").worker.address for _ in range(40))
    assert set(picks.values()) == {10}
    workers[0].outstanding = 3
    decision = router.pick(workers, _route(None), "prefill")
    assert decision.reason == "no_index" and decision.worker.address != "a"


def test_decode_prefers_free_kv_then_short_queue_then_the_prefix():
    router = make_router("kv-aware")
    full, roomy = _worker("a", free=5), _worker("b", free=95)
    assert router.pick([full, roomy], _route({"a": 10, "b": 0}), "decode").worker is roomy
    left, right = _worker("a", free=90), _worker("b", free=90)
    assert router.pick([left, right], _route({"a": 0, "b": 10}), "decode").worker is right  # near tie: prefix
    right.outstanding = 2
    assert router.pick([left, right], _route({"a": 0, "b": 10}), "decode").worker is left  # queue beats prefix


def test_prefix_affinity_is_sticky_and_balanced():
    router = make_router("prefix-affinity")
    workers = [_worker(x) for x in "abcd"]
    groups = [[g] * 20 + [100 + i] for g in range(8) for i in range(3)]
    owner: dict[int, str] = {}
    for prompt in groups:
        chosen = router.pick(workers, RouteInput(prompt, 1, None), "prefill").worker.address
        assert owner.setdefault(prompt[0], chosen) == chosen
    assert sorted(Counter(owner.values()).values()) == [2, 2, 2, 2]


def test_ties_rotate_per_tier_when_both_tiers_are_picked_per_request():
    router = make_router("kv-aware")
    prefills, decodes = [_worker("p0"), _worker("p1")], [_worker("d0"), _worker("d1")]
    seen = Counter()
    for _ in range(8):  # the gateway picks one of each tier per request
        seen[router.pick(prefills, _route({}), "prefill").worker.address] += 1
        seen[router.pick(decodes, _route({}), "decode").worker.address] += 1
    assert seen == {"p0": 4, "p1": 4, "d0": 4, "d1": 4}


def test_a_lease_counts_a_request_until_released_and_ends_the_prefill_part_early():
    decode, prefill = _worker("d"), _worker("p", outstanding=1)
    with WorkerSet().lease(decode, prefill) as lease:
        assert (decode.outstanding, prefill.outstanding) == (1, 2)
        lease.release(prefill)  # the first token came: the prefill worker's part is over
        lease.release(prefill)  # a second release changes nothing
        assert (decode.outstanding, prefill.outstanding) == (1, 1)
    assert (decode.outstanding, prefill.outstanding) == (0, 1)
