"""KV-aware routing through real processes: workers publish KV events, the gateway's prefix index
(in memory, or a real redis-server) sends prompts to the worker that holds their prefix, and
routing survives Redis going away and coming back."""

from __future__ import annotations

import time

import pytest
from cluster_helpers import engine_argv, greedy_request, metric, stub, tokens

from splitserve.services.launcher.launcher import start_cluster, stop_cluster

BASE = [(13 * j) % 290 + 5 for j in range(64)]  # 8 full blocks of 8


def _hits(worker) -> float:
    return metric(worker.metrics, "splitserve_prefix_cache_hits_total")


def _decisions(gateway, reason: str) -> float:
    return metric(gateway.metrics, "splitserve_gateway_routing_decisions_total", reason=reason)


def _send_family(gateway, base: list[int], count: int, start: int = 0) -> None:
    s = stub(gateway.address)
    for i in range(start, start + count):
        tokens(s, greedy_request(base + [1 + i, 2 + i], 2))
        time.sleep(0.25)  # let the worker publish its new blocks (every 0.1 s)


def _assert_sticky(children, base: list[int], count: int) -> None:
    gateway, workers = children[0], children[1:]
    before = [_hits(w) for w in workers]
    routed = _decisions(gateway, "prefix_hit")
    _send_family(gateway, base, count)
    gained = [_hits(w) - b for w, b in zip(workers, before)]
    # The first request computes the prefix somewhere; every later one lands where it is cached.
    assert sorted(gained) == [0, (count - 1) * len(base)], gained
    assert _decisions(gateway, "prefix_hit") - routed >= count - 1


@pytest.fixture(scope="module")
def memory_cluster(tiny_llama_dir):
    children = start_cluster(2, engine_argv(tiny_llama_dir))
    try:
        yield children
    finally:
        stop_cluster(children)


def test_in_memory_index_routes_shared_prefixes_to_their_worker(memory_cluster):
    _assert_sticky(memory_cluster, BASE, 5)
    _assert_sticky(memory_cluster, [t + 1 for t in BASE], 5)  # another family, possibly the other worker
    assert metric(memory_cluster[0].metrics, "splitserve_gateway_prefix_index_up") == 1


def test_disaggregated_tiers_route_by_prefix_too(tiny_llama_dir):
    children = start_cluster(0, engine_argv(tiny_llama_dir), num_prefill=2, num_decode=2)
    try:
        gateway, prefills = children[0], [c for c in children if c.name.startswith("prefill")]
        before = [_hits(w) for w in prefills]
        _send_family(gateway, [t + 2 for t in BASE], 4)
        gained = sorted(_hits(w) - b for w, b in zip(prefills, before))
        assert gained == [0, 3 * len(BASE)], gained
        decodes = [c for c in children if c.name.startswith("decode")]
        skipped = sum(metric(d.metrics, "splitserve_kv_transfer_blocks_skipped_total") for d in decodes)
        assert skipped >= 8  # at least one later request found its prefix on its decode worker too
    finally:
        stop_cluster(children)


def test_redis_index_routes_and_survives_redis_loss(tiny_llama_dir):
    from redis_helpers import RedisServer

    server = RedisServer().start()
    children = start_cluster(2, engine_argv(tiny_llama_dir), gateway_argv=["--redis-url", server.url])
    try:
        gateway = children[0]
        _assert_sticky(children, BASE, 4)
        keys = server.client().keys("splitserve:*")
        assert any(":block:" in k for k in keys) and any(":hb:" in k for k in keys)
        server.stop()  # Redis dies: requests still succeed, routed by load
        s = stub(gateway.address)
        for i in range(4):
            assert len(tokens(s, greedy_request(BASE + [200 + i], 2))) == 2
        assert metric(gateway.metrics, "splitserve_gateway_prefix_index_up") == 0
        assert metric(gateway.metrics, "splitserve_gateway_routing_decisions_total", reason="no_index") >= 4
        resyncs_metric = "splitserve_gateway_prefix_index_resyncs_total"
        resyncs = metric(gateway.metrics, resyncs_metric)
        server.start()  # empty Redis on the same port: workers are asked for snapshots
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and metric(gateway.metrics, resyncs_metric) < resyncs + 2:
            time.sleep(0.2)
        assert metric(gateway.metrics, resyncs_metric) >= resyncs + 2
        assert metric(gateway.metrics, "splitserve_gateway_prefix_index_up") == 1
        _assert_sticky(children, [t + 3 for t in BASE], 4)  # cache-aware again
    finally:
        stop_cluster(children)
        server.stop()
