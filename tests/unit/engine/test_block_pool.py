"""Block pool: free queue, ref counts, prefix-cache lookup, lazy eviction, events; and a property
test driving KVCacheManager with random requests."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from suites import examples

from splitserve.common.block_hash import BlockHash, extend_block_hashes, hash_block_tokens
from splitserve.common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from splitserve.services.engine.kv_cache.block_pool import BlockId, BlockPool, FreeBlockQueue, KVBlock
from splitserve.services.engine.kv_cache.manager import KVCacheManager, cdiv

BS = 4


def _ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def _cache_one(pool: BlockPool, tokens: list[int]) -> tuple[list[KVBlock], list[BlockHash]]:
    """Allocate and register blocks for tokens (a whole number of blocks); they stay referenced."""
    hashes = hash_block_tokens(tokens, BS)
    blocks = pool.allocate(len(hashes))
    pool.cache_full_blocks(blocks, hashes, tokens, None, BS)
    return blocks, hashes


# -- FreeBlockQueue -------------------------------------------------------------------------------


def test_free_queue_starts_in_block_order():
    blocks = [KVBlock(BlockId(i)) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    assert queue.num_free == 5
    assert _ids(queue) == [0, 1, 2, 3, 4]


def test_free_queue_popleft_append_remove_keep_lru_order():
    blocks = [KVBlock(BlockId(i)) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    assert queue.popleft() is blocks[0]
    queue.remove(blocks[2])  # from the middle
    assert _ids(queue) == [1, 3, 4] and queue.num_free == 3
    queue.append(blocks[2])
    queue.append(blocks[0])
    assert _ids(queue) == [1, 3, 4, 2, 0]
    queue.remove(blocks[0])  # the tail
    queue.remove(blocks[1])  # the head
    assert _ids(queue) == [3, 4, 2] and queue.num_free == 3
    assert [queue.popleft().block_id for _ in range(3)] == [3, 4, 2]
    assert queue.num_free == 0 and list(queue) == []


def test_free_queue_remove_unlinks_neighbours_directly():
    # O(1) removal: the block's own links are cut and its neighbours point at each other.
    blocks = [KVBlock(BlockId(i)) for i in range(3)]
    queue = FreeBlockQueue(blocks)
    queue.remove(blocks[1])
    assert blocks[1].prev_free is None and blocks[1].next_free is None
    assert blocks[0].next_free is blocks[2] and blocks[2].prev_free is blocks[0]


def test_free_queue_errors():
    blocks = [KVBlock(BlockId(i)) for i in range(2)]
    queue = FreeBlockQueue(blocks)
    queue.popleft()
    with pytest.raises(RuntimeError, match="not in the free queue"):
        queue.remove(blocks[0])
    queue.popleft()
    with pytest.raises(RuntimeError, match="no free KV block"):
        queue.popleft()
    assert queue.num_free == 0


# -- BlockPool ------------------------------------------------------------------------------------


def test_pool_needs_a_block():
    with pytest.raises(ValueError, match="at least one block"):
        BlockPool(0)


def test_allocate_and_free():
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    assert _ids(blocks) == [0, 1, 2]
    assert all(b.ref_cnt == 1 for b in blocks)
    assert pool.num_free_blocks == 1 and pool.num_used_blocks == 3
    assert pool.usage() == pytest.approx(0.75)
    pool.free(reversed(blocks))
    assert all(b.ref_cnt == 0 for b in blocks)
    assert pool.num_free_blocks == 4
    assert _ids(pool.free_queue) == [3, 2, 1, 0]  # freed blocks go to the tail, in the order given


def test_allocate_more_than_free_raises_and_changes_nothing():
    pool = BlockPool(3)
    pool.allocate(2)
    with pytest.raises(RuntimeError, match="asked for 2 KV blocks, 1 free"):
        pool.allocate(2)
    assert pool.num_free_blocks == 1
    assert pool.allocate(0) == []


def test_double_free_raises():
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.free([block])
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([block])
    assert block.ref_cnt == 0 and pool.num_free_blocks == 2


def test_shared_block_returns_to_free_queue_only_at_last_reference():
    pool = BlockPool(2)
    blocks, _ = _cache_one(pool, [1, 2, 3, 4])
    pool.touch(blocks)
    assert blocks[0].ref_cnt == 2
    pool.free(blocks)
    assert blocks[0].ref_cnt == 1 and pool.num_free_blocks == 1
    pool.free(blocks)
    assert blocks[0].ref_cnt == 0 and pool.num_free_blocks == 2


def test_lookup_verifies_tokens():
    pool = BlockPool(4)
    (block,), (h,) = _cache_one(pool, [1, 2, 3, 4])
    assert pool.lookup(h, [1, 2, 3, 4]) is block
    assert pool.lookup(h, (1, 2, 3, 4)) is block
    assert pool.lookup(h, [1, 2, 3, 5]) is None  # a hash hit with other tokens (a collision)
    assert pool.lookup(hash_block_tokens([9, 9, 9, 9], BS)[0], [9, 9, 9, 9]) is None


def test_freed_cached_block_stays_findable_and_touch_revives_it():
    pool = BlockPool(3)
    (block,), (h,) = _cache_one(pool, [1, 2, 3, 4])
    pool.free([block])
    assert pool.num_free_blocks == 3
    assert pool.lookup(h, [1, 2, 3, 4]) is block
    pool.touch([block])
    assert block.ref_cnt == 1
    assert block not in list(pool.free_queue)
    assert pool.num_free_blocks == 2
    assert pool.lookup(h, [1, 2, 3, 4]) is block


def test_lazy_eviction_emits_block_removed():
    pool = BlockPool(3)
    blocks, hashes = _cache_one(pool, list(range(8)))  # blocks 0 and 1
    pool.drain_events()
    pool.free(reversed(blocks))  # free queue: 2, 1, 0
    assert pool.num_cached_blocks() == 2
    (fresh,) = pool.allocate(1)  # block 2: never cached, nothing evicted
    assert fresh.block_id == 2 and pool.drain_events() == []
    (evicted,) = pool.allocate(1)  # block 1: the chain's tail goes first
    assert evicted.block_id == 1
    assert pool.drain_events() == [BlockRemoved((hashes[1],))]
    assert evicted.block_hash is None and evicted.token_ids is None
    assert pool.lookup(hashes[1], list(range(4, 8))) is None
    assert pool.lookup(hashes[0], list(range(4))) is blocks[0]
    assert pool.num_cached_blocks() == 1


def test_one_allocation_evicting_several_blocks_emits_one_event():
    pool = BlockPool(2)
    blocks, hashes = _cache_one(pool, list(range(8)))
    pool.free(blocks)
    pool.drain_events()
    pool.allocate(2)
    assert pool.drain_events() == [BlockRemoved((hashes[0], hashes[1]))]
    assert pool.num_cached_blocks() == 0


def test_cache_full_blocks_emits_block_stored():
    pool = BlockPool(4)
    tokens = list(range(12))
    hashes = hash_block_tokens(tokens, BS)
    blocks = pool.allocate(3)
    pool.cache_full_blocks(blocks[:1], hashes[:1], tokens[:4], None, BS)
    pool.cache_full_blocks(blocks[1:], hashes[1:], tokens[4:], hashes[0], BS)
    assert pool.drain_events() == [
        BlockStored((hashes[0],), None, (0, 1, 2, 3), BS),
        BlockStored((hashes[1], hashes[2]), hashes[0], tuple(range(4, 12)), BS),
    ]
    assert pool.drain_events() == []
    assert [b.block_hash for b in blocks] == hashes
    assert blocks[2].token_ids == (8, 9, 10, 11)


def test_cache_full_blocks_leaves_duplicates_private_and_splits_runs():
    pool = BlockPool(8)
    tokens = list(range(12))
    hashes = hash_block_tokens(tokens, BS)
    owner = pool.allocate(3)
    pool.cache_full_blocks(owner[1:2], hashes[1:2], tokens[4:8], hashes[0], BS)  # middle block
    pool.drain_events()
    dup = pool.allocate(3)
    pool.cache_full_blocks(dup, hashes, tokens, None, BS)
    assert dup[1].block_hash is None  # hash already cached by owner[1]: stays private
    assert pool.lookup(hashes[1], tokens[4:8]) is owner[1]
    assert pool.drain_events() == [
        BlockStored((hashes[0],), None, (0, 1, 2, 3), BS),
        BlockStored((hashes[2],), hashes[1], (8, 9, 10, 11), BS),
    ]
    # A block that already has a hash is not registered again.
    pool.cache_full_blocks(dup[:1], hashes[:1], tokens[:4], None, BS)
    assert pool.drain_events() == []


def test_caching_disabled_stores_nothing():
    pool = BlockPool(2, enable_caching=False)
    tokens = list(range(4))
    (h,) = hash_block_tokens(tokens, BS)
    (block,) = pool.allocate(1)
    pool.cache_full_blocks([block], [h], tokens, None, BS)
    assert block.block_hash is None
    assert pool.lookup(h, tokens) is None
    assert pool.drain_events() == []


def test_reset_prefix_cache():
    pool = BlockPool(3)
    blocks, hashes = _cache_one(pool, list(range(8)))
    pool.drain_events()
    assert pool.reset_prefix_cache() is False  # blocks in use
    assert pool.drain_events() == []
    assert pool.lookup(hashes[0], list(range(4))) is blocks[0]
    pool.free(blocks)
    assert pool.reset_prefix_cache() is True
    assert pool.drain_events() == [AllBlocksCleared()]
    assert pool.num_cached_blocks() == 0
    assert pool.lookup(hashes[0], list(range(4))) is None
    assert all(b.block_hash is None for b in pool.blocks)
    pool.allocate(3)
    assert pool.drain_events() == []  # nothing left to evict


# -- KVCacheManager ---------------------------------------------------------------------------------


class FakeRequest:
    """The KVRequest protocol, nothing more."""

    def __init__(self, request_id: str, token_ids: list[int], block_size: int) -> None:
        self.request_id = request_id
        self.num_computed_tokens = 0
        self.all_token_ids = list(token_ids)
        self.block_size = block_size
        self.block_hashes: list[BlockHash] = []
        extend_block_hashes(self.block_hashes, self.all_token_ids, block_size)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    def append(self, token_ids: list[int]) -> None:
        self.all_token_ids.extend(token_ids)
        extend_block_hashes(self.block_hashes, self.all_token_ids, self.block_size)


def _admit(kv: KVCacheManager, request: FakeRequest) -> bool:
    hit = kv.find_prefix_hit(request)
    if not kv.allocate_slots(request, request.num_tokens - hit.num_tokens, hit):
        return False
    request.num_computed_tokens = request.num_tokens
    kv.cache_blocks(request)
    return True


def test_prefix_hit_reuses_blocks_and_leaves_one_token_to_compute():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a = FakeRequest("a", list(range(8)), BS)  # exactly two full blocks
    assert kv.find_prefix_hit(a).num_tokens == 0
    assert _admit(kv, a)
    b = FakeRequest("b", list(range(8)), BS)
    hit = kv.find_prefix_hit(b)
    assert hit.num_tokens == 4 and hit.blocks[0].block_id == kv.block_ids("a")[0]
    c = FakeRequest("c", list(range(8)) + [99], BS)
    assert kv.find_prefix_hit(c).num_tokens == 8
    assert _admit(kv, c)
    assert kv.block_ids("c")[:2] == kv.block_ids("a")
    assert kv.pool.blocks[kv.block_ids("a")[0]].ref_cnt == 2


def test_prefix_hit_stops_at_first_miss():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    assert _admit(kv, FakeRequest("a", list(range(12)), BS))
    other = FakeRequest("b", [0, 1, 2, 3, 0, 0, 0, 0, 8, 9, 10, 11, 1], BS)
    assert kv.find_prefix_hit(other).num_tokens == 4


def test_allocate_slots_failure_changes_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    a = FakeRequest("a", list(range(8)), BS)
    assert _admit(kv, a)
    kv.free(a)  # both blocks are free but cached
    b = FakeRequest("b", list(range(8)) + list(range(50, 58)), BS)  # hit of 2 blocks + 2 new > 3
    hit = kv.find_prefix_hit(b)
    assert hit.num_tokens == 8
    assert kv.allocate_slots(b, b.num_tokens - hit.num_tokens, hit) is False
    assert kv.num_free_blocks == 3 and not kv.holds("b")
    assert all(block.ref_cnt == 0 for block in kv.pool.blocks)
    assert kv.find_prefix_hit(b).num_tokens == 8  # nothing evicted


def test_caching_disabled_manager_never_hits():
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_caching=False)
    assert _admit(kv, FakeRequest("a", list(range(9)), BS))
    assert kv.find_prefix_hit(FakeRequest("b", list(range(9)), BS)).num_tokens == 0


# Shared prompt stems make prefix hits (on live and on freed-but-cached blocks) common.
STEMS = [[], [0, 1, 2, 0], [0, 1, 2, 0, 2, 2, 1, 1], [1, 1, 1, 1, 0, 0, 0, 0]]


class KVCacheMachine(RuleBasedStateMachine):
    """Random add / extend / free of requests over a small pool with a tiny token alphabet."""

    NUM_BLOCKS = 8

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(self.NUM_BLOCKS, BS)
        self.live: dict[str, FakeRequest] = {}
        self.next_id = 0
        self.index: set[BlockHash] = set()  # the cache as a consumer of the events sees it

    @rule(stem=st.sampled_from(STEMS), tail=st.lists(st.integers(0, 2), max_size=12))
    def add(self, stem, tail):
        tokens = stem + tail or [0]
        rid = f"r{self.next_id}"
        self.next_id += 1
        request = FakeRequest(rid, tokens, BS)
        num_free = self.kv.num_free_blocks
        if _admit(self.kv, request):
            self.live[rid] = request
            assert self.kv.num_blocks_of(rid) == cdiv(request.num_tokens, self.kv.block_size)
        else:
            assert not self.kv.holds(rid) and self.kv.num_free_blocks == num_free

    @precondition(lambda self: self.live)
    @rule(data=st.data(), tokens=st.lists(st.integers(0, 2), min_size=1, max_size=6))
    def extend(self, data, tokens):
        request = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        request.append(tokens)
        num_new = request.num_tokens - request.num_computed_tokens  # may include earlier misses
        num_free = self.kv.num_free_blocks
        if self.kv.allocate_slots(request, num_new):
            request.num_computed_tokens += num_new
            self.kv.cache_blocks(request)
        else:
            assert self.kv.num_free_blocks == num_free

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        request = self.live.pop(data.draw(st.sampled_from(sorted(self.live))))
        self.kv.free(request)
        assert not self.kv.holds(request.request_id)

    @invariant()
    def ref_counts_match_holders(self):
        pool = self.kv.pool
        holders = [0] * pool.num_blocks
        for rid in self.live:
            for block_id in self.kv.block_ids(rid):
                holders[block_id] += 1
        assert [b.ref_cnt for b in pool.blocks] == holders  # also: every ref_cnt >= 0
        in_queue = {b.block_id for b in pool.free_queue}
        assert in_queue == {b.block_id for b in pool.blocks if b.ref_cnt == 0}
        assert len(in_queue) == pool.num_free_blocks
        assert pool.num_free_blocks + sum(b.ref_cnt > 0 for b in pool.blocks) == pool.num_blocks
        assert pool.num_free_blocks + pool.num_used_blocks == pool.num_blocks

    @invariant()
    def held_blocks_hold_the_right_tokens(self):
        pool = self.kv.pool
        for request in self.live.values():
            ids = self.kv.block_ids(request.request_id)
            assert len(ids) >= cdiv(request.num_computed_tokens, self.kv.block_size)
            assert len(set(ids)) == len(ids)
            for i, block_id in enumerate(ids[: request.num_computed_tokens // BS]):
                block = pool.blocks[block_id]
                if block.block_hash is not None:  # a cached block must be this request's block i
                    assert block.block_hash == request.block_hashes[i]
                    assert block.token_ids == tuple(request.all_token_ids[i * BS : (i + 1) * BS])
        for block in pool.blocks:
            if block.block_hash is not None:
                assert pool.lookup(block.block_hash, block.token_ids) is block

    @invariant()
    def events_mirror_the_cache(self):
        for event in self.kv.pool.drain_events():
            if isinstance(event, BlockStored):
                assert event.block_hashes == tuple(hash_block_tokens(event.token_ids, BS, event.parent_hash))
                assert self.index.isdisjoint(event.block_hashes)
                self.index.update(event.block_hashes)
            else:
                assert isinstance(event, BlockRemoved)
                assert self.index.issuperset(event.block_hashes)
                self.index.difference_update(event.block_hashes)
        assert self.index == {b.block_hash for b in self.kv.pool.blocks if b.block_hash is not None}

    def teardown(self):
        for request in self.live.values():
            self.kv.free(request)
        self.live.clear()
        assert self.kv.num_free_blocks == self.NUM_BLOCKS
        assert all(b.ref_cnt == 0 for b in self.kv.pool.blocks)
        assert len(list(self.kv.pool.free_queue)) == self.NUM_BLOCKS


KVCacheMachine.TestCase.settings = settings(
    max_examples=examples(200),
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_kv_cache_manager_properties = KVCacheMachine.TestCase
