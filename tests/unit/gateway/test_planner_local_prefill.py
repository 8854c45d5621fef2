"""Conditional disaggregation in the gateway's planner (gateway/planner.py): with prefill and decode
workers up, a request goes to a (prefill, decode) pair unless a LocalPrefill rule sends it to a decode
worker alone: a short prompt (counting only the tokens no decode worker holds), every prefill worker's
queue at the threshold, no healthy prefill worker, or a migrated stream; each counted by reason."""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry

from splitserve.gateway.metrics import LOCAL_PREFILL_REASONS, GatewayMetrics
from splitserve.gateway.planner import LocalPrefill, Planner
from splitserve.gateway.prefix import PrefixIndex, PrefixIndexMetrics
from splitserve.gateway.router import make_router
from splitserve.gateway.workers import WorkerSet
from splitserve.protos.v1 import worker_pb2 as pb

BLOCK = 8


def _plans(rules: LocalPrefill, asks, *, num_prefill: int = 1, prefill_queue: int = 0):
    """Each ask (prompt, migrated, held): held, blocks of the prompt a decode worker is known to hold.
    Returns each plan's (prefill address or None, target role) and the local prefills by reason."""
    metrics = GatewayMetrics()

    async def run():
        workers = WorkerSet()
        for i in range(num_prefill):
            w = workers.add(
                pb.RegisterWorkerRequest(address=f"p{i}:1", role=pb.WORKER_ROLE_PREFILL, model="m", block_size=BLOCK)
            )
            w.load = pb.LoadReport(num_waiting=prefill_queue, block_size=BLOCK)
        workers.add(pb.RegisterWorkerRequest(address="d0:1", role=pb.WORKER_ROLE_DECODE, model="m", block_size=BLOCK))
        prefix = PrefixIndex("m", None, PrefixIndexMetrics(CollectorRegistry()))
        planner = Planner("m", workers, make_router("kv-aware"), prefix, metrics.routed, metrics.local_prefills, rules)
        got = []
        for prompt, migrated, held in asks:
            if held:
                hashes = (await planner._route_input(prompt, workers.healthy("m"))).block_hashes
                prefix.note_routed(hashes[:held], "d0:1")
            plan = await planner.plan(prompt, set(), retry=False, migrated=migrated)
            got.append((plan.prefill.worker.address if plan.prefill else None, plan.target.worker.role_name))
        await workers.close()
        return got

    got = asyncio.run(run())
    counts = {
        r: metrics.registry.get_sample_value("splitserve_gateway_local_prefills_total", {"reason": r})
        for r in LOCAL_PREFILL_REASONS
    }
    return got, {r: n for r, n in counts.items() if n}


def test_pairs_by_default_and_one_decode_worker_for_a_moved_stream():
    short, long = list(range(1, 9)), list(range(1, 200))
    got, counts = _plans(LocalPrefill(), [(short, False, 0), (long, False, 0), (long, True, 0)])
    assert got == [("p0:1", "decode"), ("p0:1", "decode"), (None, "decode")]
    assert counts == {"migration": 1}


def test_a_short_prompt_or_a_long_prefill_queue_is_computed_on_the_decode_worker():
    rules = LocalPrefill(max_tokens=32)
    prompt_40 = list(range(101, 141))  # shares no block with the first prompt
    got, counts = _plans(rules, [(list(range(1, 33)), False, 0), (prompt_40, False, 0), (prompt_40, False, 2)])
    # 32 tokens: local; 40: a pair; 40 of which the decode worker holds 2 blocks (16 tokens): 24 to compute, local
    assert got == [(None, "decode"), ("p0:1", "decode"), (None, "decode")]
    assert counts == {"short_prompt": 2}
    queued, counts = _plans(LocalPrefill(min_queue=4), [(prompt_40, False, 0)], num_prefill=2, prefill_queue=4)
    assert queued == [(None, "decode")] and counts == {"prefill_queue": 1}
    below, counts = _plans(LocalPrefill(min_queue=4), [(prompt_40, False, 0)], num_prefill=2, prefill_queue=3)
    assert below[0][0] is not None and counts == {}


def test_no_prefill_worker_up_is_counted():
    got, counts = _plans(LocalPrefill(), [([1, 2, 3], False, 0)], num_prefill=0)
    assert got == [(None, "decode")] and counts == {"no_prefill_worker": 1}
