"""The prefix index's contract (tests/kv_index_cases.py) on a real redis-server, and what only Redis
does: outages, hangs, and a purge racing an update."""

from __future__ import annotations

import time
import uuid

import pytest
from kv_index_cases import *  # noqa: F403  (the cases and their fixtures)
from kv_index_cases import APPLIED, RESYNC, A, H, batch, snapshot, stored
from redis_helpers import RedisServer

from splitserve.gateway.kv_index import IndexUnavailable
from splitserve.gateway.kv_index.redis_index import RedisIndex


@pytest.fixture
def backend_name() -> str:
    return "redis"


def test_redis_outage_raises_quickly_and_the_same_index_recovers(run):
    with RedisServer() as server:
        index = RedisIndex(uuid.uuid4().hex, server.url)
        try:
            assert run(index.apply(snapshot(A, 1, H[0]))) is APPLIED
            server.stop()
            calls = [
                index.apply(batch(A, 2)),
                index.lookup(H[:1], [A]),
                index.purge_dead(),
                index.blocks_of(A),
                index.remove_worker(A),
            ]
            for call in calls:
                started = time.monotonic()
                with pytest.raises(IndexUnavailable, match=f"redis index at {server.url}: .* failed"):
                    run(call)
                assert time.monotonic() - started < 1.0
            server.start()  # same port, empty: every worker must resync
            assert run(index.apply(batch(A, 3, stored(H[1])))) is RESYNC
            assert run(index.apply(snapshot(A, 4, H[0], H[1]))) is APPLIED
            assert run(index.lookup(H[:2], [A])) == {A: 2}
            server.stop()
            server.start()  # no call in between: the pooled connection is stale, not known broken
            assert run(index.apply(batch(A, 5))) is RESYNC
        finally:
            run(index.close())


def test_hung_redis_times_out_instead_of_blocking(run):
    with RedisServer() as server:
        index = RedisIndex(uuid.uuid4().hex, server.url)
        try:
            run(index.apply(snapshot(A, 1, H[0])))
            server.pause()
            started = time.monotonic()
            with pytest.raises(IndexUnavailable, match="lookup failed"):
                run(index.lookup(H[:1], [A]))
            assert time.monotonic() - started < 1.0  # one 0.5 s socket timeout, no retry
            server.resume()
            assert run(index.lookup(H[:1], [A])) == {A: 1}
        finally:
            run(index.close())


def test_redis_purge_between_apply_read_and_write_forces_a_resync(redis_server, run, monkeypatch):
    namespace = uuid.uuid4().hex
    index, other_gateway = RedisIndex(namespace, redis_server.url), RedisIndex(namespace, redis_server.url)
    try:
        run(index.apply(snapshot(A, 1, H[0])))
        read = index._read_stream

        async def read_then_removed(worker: str, cleared: bool):
            found = await read(worker, cleared)
            await other_gateway.remove_worker(worker)
            return found

        monkeypatch.setattr(index, "_read_stream", read_then_removed)
        assert run(index.apply(batch(A, 2, stored(H[1])))) is RESYNC
        monkeypatch.undo()
        assert run(index.apply(batch(A, 3))) is RESYNC  # not a continuation of a lost history
        assert run(index.apply(snapshot(A, 4, H[2]))) is APPLIED
        assert run(index.blocks_of(A)) == {H[2]}
        assert run(index.lookup(H[1:3], [A])) == {A: 0}
        assert run(index.lookup(H[2:3], [A])) == {A: 1}
    finally:
        run(index.close())
        run(other_gateway.close())
