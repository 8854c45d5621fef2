"""The persistent block table and the decode fast path: block rows change only when a request's
blocks change, and steady decoding asks the pool only for the requests that start a block."""

from __future__ import annotations

import random

import numpy as np
import pytest

from splitserve.common.sampling_params import SamplingParams
from splitserve.services.engine.config import RuntimeInfo, SchedulerConfig
from splitserve.services.engine.kv_cache.block_table import BlockTable
from splitserve.services.engine.kv_cache.manager import KVCacheManager
from splitserve.services.engine.request import Request, RequestId
from splitserve.services.engine.scheduler import Scheduler

BS = 4


def test_rows_are_recycled_zeroed_and_grow():
    table = BlockTable(max_blocks_per_row=3, num_rows=2)
    table.append("a", [5, 6])
    table.append("b", [7])
    table.append("a", [8])
    assert table.gather(table.rows(["a", "b"])).tolist() == [[5, 6, 8], [7, 0, 0]]
    table.remove("a")
    table.append("c", [9])  # takes a's row, zeroed
    assert table.gather(table.rows(["c"])).tolist() == [[9]]
    table.append("d", [1, 2, 3])  # a third row: the table doubles
    assert table.gather(table.rows(["b", "c", "d"])).tolist() == [[7, 0, 0], [9, 0, 0], [1, 2, 3]]
    with pytest.raises(ValueError, match="would hold 4 blocks"):
        table.append("d", [4])


def _request(rid: str, num_tokens: int) -> Request:
    prompt = list(range(1, num_tokens + 1))
    return Request(RequestId(rid), prompt, SamplingParams(), max_tokens=64, eos_token_ids=frozenset(), block_size=BS)


def test_the_managers_table_follows_its_blocks():
    kv = KVCacheManager(32, BS)
    rng = random.Random(0)
    live: dict[str, Request] = {}
    for i in range(200):
        if live and rng.random() < 0.3:
            kv.free(live.pop(rng.choice(sorted(live))))
        else:
            request = live.get(f"r{i % 7}") or _request(f"r{i % 7}", rng.randrange(1, 9))
            if kv.allocate_slots(request, rng.randrange(1, 6)):
                request.num_computed_tokens = kv.num_blocks_of(request.request_id) * BS - rng.randrange(BS)
                live[request.request_id] = request
        ids = sorted(live)
        table = kv.block_table(ids)
        for row, rid in zip(table, ids):
            blocks = kv.block_ids(rid)
            assert row[: len(blocks)].tolist() == blocks and not row[len(blocks) :].any()


def test_next_blocks_all_or_none():
    kv = KVCacheManager(3, BS)
    a, b = _request("a", BS), _request("b", BS)
    for request in (a, b):
        assert kv.allocate_slots(request, BS)
        request.num_computed_tokens = BS  # its block is full
    assert not kv.allocate_next_blocks([a, b, a])  # three wanted, one free: nothing taken
    assert kv.num_free_blocks == 1
    assert kv.allocate_next_blocks([a])
    assert kv.num_blocks_of("a") == 2 and kv.num_free_blocks == 0
    assert kv.allocate_next_blocks([a])  # not full any more: needs none
    assert kv.block_table(["a", "b"]).shape == (2, 2)


def test_steady_decoding_asks_the_pool_only_at_block_boundaries(monkeypatch):
    kv = KVCacheManager(64, BS)
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64)
    sched = Scheduler(config, RuntimeInfo(64, BS, 256, frozenset()), kv)
    for i in range(6):
        sched.add_request(_request(f"r{i}", 3 + i))  # prompts of 3..8 tokens: boundaries on different steps
    out = sched.schedule()
    sched.update(out, [7] * len(out.sampling_requests()))
    slots, next_blocks = [], []
    real_next = kv.allocate_next_blocks
    monkeypatch.setattr(kv, "allocate_slots", lambda *args, **kwargs: slots.append(args) or True)
    monkeypatch.setattr(kv, "allocate_next_blocks", lambda rs: next_blocks.append(list(rs)) or real_next(rs))
    for _ in range(2 * BS):
        out = sched.schedule()
        assert len(out.decodes) == 6 and not out.chunks
        starting = [r for r in out.decodes if r.num_computed_tokens % BS == 0]
        assert next_blocks.pop() == starting if starting else not next_blocks
        assert np.array_equal(out.block_table[:, : kv.num_blocks_of("r0")][0], kv.block_ids("r0"))
        sched.update(out, [7] * len(out.decodes))
    assert slots == []
