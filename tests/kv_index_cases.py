"""Contract tests of the prefix index, run against every backend: the in-memory one by
tests/unit/gateway/test_kv_index.py, a real redis-server by tests/integration/test_kv_index_redis.py."""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from redis_helpers import RedisServer

from splitserve.common.block_hash import BlockHash, hash_block_tokens
from splitserve.common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from splitserve.gateway.kv_index import ApplyResult, EventBatch, KVIndex, make_index
from splitserve.services.engine.kv_cache.block_pool import BlockPool, KVBlock

APPLIED, RESYNC = ApplyResult.APPLIED, ApplyResult.RESYNC
BLOCK_SIZE = 4
H = hash_block_tokens(list(range(8 * BLOCK_SIZE)), BLOCK_SIZE)  # 8 chained hashes
A, B, C = "10.0.0.1:7001", "10.0.0.2:7001", "10.0.0.3:7001"  # addresses: ':' inside key names


def stored(*hashes: BlockHash) -> BlockStored:
    return BlockStored(hashes, None, (), BLOCK_SIZE)  # the index reads only the hashes


def removed(*hashes: BlockHash) -> BlockRemoved:
    return BlockRemoved(hashes)


def batch(worker: str, seq: int, *events, instance: str = "i1") -> EventBatch:
    return EventBatch(worker, instance, seq, tuple(events))


def snapshot(worker: str, seq: int, *hashes: BlockHash, instance: str = "i1", events=()) -> EventBatch:
    return EventBatch(worker, instance, seq, tuple(events), snapshot=hashes)


@dataclass(frozen=True)
class Backend:
    """Makes indexes of one backend, each in a fresh namespace, and restarts them."""

    name: str
    server: RedisServer | None
    run: Callable
    made: list[KVIndex] = field(default_factory=list)

    def make(self, namespace: str | None = None, heartbeat_ttl_s: float = 5.0) -> KVIndex:
        url = self.server.url if self.server else None
        index = make_index(namespace or uuid.uuid4().hex, url, heartbeat_ttl_s)
        assert index.name == self.name
        self.made.append(index)
        return index

    def restart(self, index: KVIndex) -> KVIndex:
        """The index after it lost every state: a new in-memory index, or Redis flushed."""
        if self.server is None:
            return self.make(index.namespace, index.heartbeat_ttl_s)
        with self.server.client() as client:
            client.flushdb()
        return index


@pytest.fixture(scope="module")
def redis_server():
    with RedisServer() as server:
        yield server


@pytest.fixture
def run():
    """Runs a coroutine on this test's one event loop (the Redis client's connections live on it)."""
    loop = asyncio.new_event_loop()
    yield loop.run_until_complete
    loop.close()


# In-process for the memory backend, a redis-server process for Redis: each test module that imports
# these cases names its backend with a backend_name fixture.
@pytest.fixture
def backend(request, backend_name, run):
    server = request.getfixturevalue("redis_server") if backend_name == "redis" else None
    backend = Backend(backend_name, server, run)
    yield backend
    for index in backend.made:
        run(index.close())


@pytest.fixture
def index(backend) -> KVIndex:
    return backend.make()


def test_first_batch_of_an_unknown_worker_asks_for_a_snapshot(index, run):
    assert run(index.apply(batch(A, 1, stored(H[0])))) is RESYNC
    assert run(index.blocks_of(A)) == set()
    assert run(index.apply(snapshot(A, 1, H[0]))) is APPLIED
    assert run(index.blocks_of(A)) == {H[0]}


def test_lookup_counts_leading_blocks_of_each_live_worker(index, run):
    assert run(index.apply(snapshot(A, 1))) is APPLIED
    assert run(index.apply(batch(A, 2, stored(H[0], H[1]), stored(H[2])))) is APPLIED
    assert run(index.apply(snapshot(B, 1, H[0], H[2]))) is APPLIED  # H[1] missing: stops at 1
    assert run(index.lookup(H[:4], [A, B, C])) == {A: 3, B: 1, C: 0}
    assert run(index.lookup(H[1:3], [A, B])) == {A: 2, B: 0}
    assert run(index.lookup([], [A])) == {A: 0}
    assert run(index.lookup(H[:2], [])) == {}


def test_gap_in_seq_resyncs_and_applies_nothing(index, run):
    run(index.apply(snapshot(A, 1, H[0])))
    assert run(index.apply(batch(A, 3, stored(H[1])))) is RESYNC  # batch 2 was lost
    assert run(index.apply(batch(A, 1, stored(H[1])))) is RESYNC  # a replay
    assert run(index.blocks_of(A)) == {H[0]}
    assert run(index.apply(batch(A, 2, stored(H[2])))) is APPLIED
    assert run(index.blocks_of(A)) == {H[0], H[2]}


def test_new_instance_resyncs(index, run):
    run(index.apply(snapshot(A, 1, H[0], instance="old")))
    assert run(index.apply(batch(A, 2, stored(H[1]), instance="new"))) is RESYNC
    assert run(index.apply(batch(A, 1, stored(H[1]), instance="new"))) is RESYNC
    assert run(index.blocks_of(A)) == {H[0]}
    assert run(index.apply(snapshot(A, 1, H[3], instance="new"))) is APPLIED
    assert run(index.blocks_of(A)) == {H[3]}
    assert run(index.apply(batch(A, 2, instance="old"))) is RESYNC


def test_snapshot_replaces_the_workers_blocks_and_restarts_seq(index, run):
    run(index.apply(snapshot(A, 1)))
    run(index.apply(batch(A, 2, stored(H[0], H[1], H[2]))))
    run(index.apply(snapshot(B, 1, H[1])))
    assert run(index.apply(snapshot(A, 7, H[1], H[3]))) is APPLIED
    assert run(index.blocks_of(A)) == {H[1], H[3]}
    assert run(index.blocks_of(B)) == {H[1]}
    assert run(index.lookup(H[:1], [A, B])) == {A: 0, B: 0}
    assert run(index.lookup(H[1:2], [A, B])) == {A: 1, B: 1}
    assert run(index.apply(batch(A, 3))) is RESYNC
    assert run(index.apply(batch(A, 8, removed(H[3])))) is APPLIED
    assert run(index.blocks_of(A)) == {H[1]}


def test_removed_and_cleared_blocks(index, run):
    run(index.apply(snapshot(A, 1, *H[:4])))
    run(index.apply(snapshot(B, 1, H[0])))
    run(index.apply(batch(A, 2, removed(H[3], H[5]))))  # H[5] was never stored: ignored
    assert run(index.blocks_of(A)) == set(H[:3])
    assert run(index.lookup(H[:4], [A])) == {A: 3}
    run(index.apply(batch(A, 3, AllBlocksCleared())))
    assert run(index.blocks_of(A)) == set()
    assert run(index.lookup(H[:1], [A, B])) == {A: 0, B: 1}
    events = (stored(H[0], H[1]), removed(H[0]), AllBlocksCleared(), stored(H[2], H[3]), removed(H[2]))
    run(index.apply(batch(A, 4, *events)))
    assert run(index.blocks_of(A)) == {H[3]}
    # A snapshot's own events come after it.
    run(index.apply(snapshot(A, 1, H[0], H[1], events=(removed(H[1]), stored(H[4])))))
    assert run(index.blocks_of(A)) == {H[0], H[4]}


def test_namespaces_never_mix(backend, run):
    first, second = backend.make(), backend.make()
    run(first.apply(snapshot(A, 1, H[0], H[1])))
    run(second.apply(snapshot(A, 1, H[5])))
    assert run(first.apply(batch(A, 2))) is APPLIED
    assert run(second.lookup(H[:2], [A])) == {A: 0}
    assert run(second.apply(batch(A, 3))) is RESYNC  # second is still at seq 1
    run(second.remove_worker(A))
    assert run(first.blocks_of(A)) == {H[0], H[1]}
    assert run(first.lookup(H[:2], [A])) == {A: 2}
    assert run(first.apply(batch(A, 3))) is APPLIED


def test_expired_heartbeat_hides_then_purges_a_worker(backend, run):
    index = backend.make(heartbeat_ttl_s=0.4)
    run(index.apply(snapshot(A, 1, H[0], H[1])))
    run(index.apply(snapshot(B, 1, H[0])))
    time.sleep(0.25)
    assert run(index.apply(batch(B, 2))) is APPLIED  # an empty batch is B's heartbeat
    time.sleep(0.25)  # A last heard 0.5 s ago, B 0.25 s ago
    assert run(index.lookup(H[:2], [A, B])) == {A: 0, B: 1}
    assert run(index.blocks_of(A)) == {H[0], H[1]}  # hidden, not yet deleted
    assert run(index.purge_dead()) == [A]
    assert run(index.blocks_of(A)) == set()
    assert run(index.blocks_of(B)) == {H[0]}
    assert run(index.apply(batch(A, 2, stored(H[2])))) is RESYNC  # its position went too
    assert run(index.apply(snapshot(A, 3, H[1]))) is APPLIED
    assert run(index.lookup(H[:2], [A])) == {A: 0}  # H[0] went with the purge
    assert run(index.lookup(H[1:2], [A])) == {A: 1}


def test_remove_worker(index, run):
    run(index.apply(snapshot(A, 1, H[0])))
    run(index.apply(snapshot(B, 1, H[0])))
    run(index.remove_worker(A))
    run(index.remove_worker(C))  # unknown: nothing to do
    assert run(index.blocks_of(A)) == set()
    assert run(index.lookup(H[:1], [A, B])) == {A: 0, B: 1}
    assert run(index.apply(batch(A, 2))) is RESYNC
    assert run(index.purge_dead()) == []
    run(index.apply(snapshot(A, 3, H[1])))
    assert run(index.lookup(H[:2], [A, B])) == {A: 0, B: 1}


class SimWorker:
    """A worker's block pool, driven the way the engine drives it, and its event publisher."""

    def __init__(self, name: str, rng: random.Random) -> None:
        self.name, self.rng = name, rng
        self.restart(need_snapshot=True)

    def restart(self, need_snapshot: bool) -> None:
        self.pool, self.running = BlockPool(12), []
        self.instance, self.seq = uuid.uuid4().hex, 0
        self.need_snapshot = need_snapshot  # a fresh publisher starts with one; test both ways

    def start_request(self, tokens: list[int]) -> None:
        hashes = hash_block_tokens(tokens, BLOCK_SIZE)
        hits: list[KVBlock] = []
        for i, block_hash in enumerate(hashes):
            block = self.pool.lookup(block_hash, tokens[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE])
            if block is None:
                break
            hits.append(block)
        num_new = -(-len(tokens) // BLOCK_SIZE) - len(hits)  # the partial tail block too
        if num_new + sum(b.ref_cnt == 0 for b in hits) > self.pool.num_free_blocks:
            return
        self.pool.touch(hits)
        new = self.pool.allocate(num_new)  # may evict cached blocks: BlockRemoved
        start = len(hits)
        parent = hashes[start - 1] if start else None
        self.pool.cache_full_blocks(
            new[: len(hashes) - start], hashes[start:], tokens[start * BLOCK_SIZE :], parent, BLOCK_SIZE
        )
        self.running.append(hits + new)

    def finish_request(self) -> None:
        if self.running:
            blocks = self.running.pop(self.rng.randrange(len(self.running)))
            self.pool.free(reversed(blocks))

    def next_batch(self) -> EventBatch:
        events = tuple(self.pool.drain_events())
        self.seq += 1
        if self.need_snapshot:
            self.need_snapshot = False
            return EventBatch(self.name, self.instance, self.seq, snapshot=tuple(self.pool.cached_hashes()))
        return EventBatch(self.name, self.instance, self.seq, events)


def random_prompt(rng: random.Random, prefixes: list[list[int]]) -> list[int]:
    """A shared prefix plus a private tail, so workers hold overlapping chains."""
    prefix = rng.choice(prefixes)[: rng.randrange(0, 25)]
    return prefix + [rng.randrange(1000, 2000) for _ in range(rng.randrange(1, 9))]


def expected_lookup(workers: list[SimWorker], hashes: list[BlockHash]) -> dict[str, int]:
    counts = {}
    for worker in workers:
        cached = set(worker.pool.cached_hashes())
        counts[worker.name] = next((i for i, h in enumerate(hashes) if h not in cached), len(hashes))
    return counts


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_events_with_lost_batches_and_restarts_converge(backend, run, seed):
    rng = random.Random(seed)
    index = backend.make()
    prefixes = [[rng.randrange(50) for _ in range(24)] for _ in range(3)]
    workers = [SimWorker(name, rng) for name in (A, B, C)]
    counts = {"resync": 0, "events_applied": 0, "lost": 0}

    def publish(worker: SimWorker, may_lose: bool = True) -> ApplyResult | None:
        sent = worker.next_batch()
        if may_lose and rng.random() < 0.15:
            counts["lost"] += 1  # the publisher believes it went out; the index sees the gap later
            return None
        if run(index.apply(sent)) is RESYNC:
            counts["resync"] += 1
            worker.need_snapshot = True
            return RESYNC
        counts["events_applied"] += sent.snapshot is None and bool(sent.events)
        # Whatever path it took, an applied batch leaves the index equal to the pool.
        assert run(index.blocks_of(worker.name)) == set(worker.pool.cached_hashes())
        return APPLIED

    for _ in range(1000):
        worker, op = rng.choice(workers), rng.random()
        if op < 0.4:
            worker.start_request(random_prompt(rng, prefixes))
        elif op < 0.65:
            worker.finish_request()
        elif op < 0.93:
            publish(worker)
        elif op < 0.95:
            worker.restart(need_snapshot=rng.random() < 0.5)
        elif op < 0.97 and not worker.running:
            worker.pool.reset_prefix_cache()
        elif op >= 0.97:
            index = backend.restart(index)

    for worker in workers:  # a final batch each, and the snapshot it may be asked for
        while publish(worker, may_lose=False) is not APPLIED:
            pass
    names = [w.name for w in workers]
    for worker in workers:
        assert run(index.blocks_of(worker.name)) == set(worker.pool.cached_hashes())
    for _ in range(30):
        hashes = hash_block_tokens(random_prompt(rng, prefixes), BLOCK_SIZE)
        assert run(index.lookup(hashes, names + ["nobody"])) == {**expected_lookup(workers, hashes), "nobody": 0}
    assert sum(w.pool.num_cached_blocks() for w in workers) > 0
    assert min(counts.values()) > 0, counts  # every path (resync, events, loss) was exercised
