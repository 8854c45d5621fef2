"""The prefix index in Redis (--redis-url): gateways that share a Redis share one index.

Keys, all under `splitserve:{namespace}:`; block hashes are written as lowercase hex:
- `block:{hash_hex}`        SET     workers holding the block (what lookup reads)
- `worker:{worker}:blocks`  SET     hash hexes the worker holds (to replace or purge its blocks)
- `worker:{worker}:state`   HASH    {instance, seq}: the last batch applied from its stream
- `hb:{worker}`             STRING  its instance; expires heartbeat_ttl_s after that batch (PX)
- `workers`                 SET     every worker with state (what purge_dead scans)

Round trips: apply reads the stream position (plus the worker's hashes when the batch replaces or
clears them) in one pipeline and writes in one MULTI/EXEC; lookup is one pipeline.

Failures: every Redis error raises IndexUnavailable. Socket timeouts are short and only a refused or
closed connection is retried (once, at once), so a dead or hung Redis costs a routing decision about
half a second at most. The client reconnects on its own when Redis is back; Redis then has no state,
so each worker's next batch gets RESYNC and its snapshot rebuilds the index.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import cast
from urllib.parse import urlsplit, urlunsplit

import redis
import redis.asyncio
from redis.asyncio.client import Pipeline
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from splitserve.common.block_hash import BlockHash
from splitserve.gateway.kv_index.base import (
    ApplyResult,
    BlockChange,
    EventBatch,
    IndexUnavailable,
    KVIndex,
    StreamPosition,
    continues_stream,
    count_leading,
    net_change,
    register_index,
)

_SOCKET_TIMEOUT_S = 0.5  # a dead or stuck Redis must not hold up routing for long
# The builtin ConnectionError and TimeoutError are OSErrors; asyncio's TimeoutError is not before 3.11.
_ERRORS = (redis.RedisError, OSError, asyncio.TimeoutError)


def _decoded(members: set[bytes | str]) -> set[str]:
    """A set reply as the str it is: the client decodes every reply (decode_responses=True), which
    redis-py's annotations do not follow."""
    return cast(set[str], members)


@dataclass(frozen=True, slots=True)
class _Keys:
    prefix: str  # "splitserve:{namespace}:"

    def block(self, hash_hex: str) -> str:
        return f"{self.prefix}block:{hash_hex}"

    def blocks(self, worker: str) -> str:
        return f"{self.prefix}worker:{worker}:blocks"

    def state(self, worker: str) -> str:
        return f"{self.prefix}worker:{worker}:state"

    def heartbeat(self, worker: str) -> str:
        return f"{self.prefix}hb:{worker}"

    @property
    def workers(self) -> str:
        return f"{self.prefix}workers"


@register_index
class RedisIndex(KVIndex):
    name = "redis"

    def __init__(self, namespace: str, redis_url: str, heartbeat_ttl_s: float = 5.0) -> None:
        super().__init__(namespace, heartbeat_ttl_s)
        self._keys = _Keys(f"splitserve:{namespace}:")
        self._where = _without_password(redis_url)
        # One immediate retry on a connection error replaces a pooled connection that a Redis restart
        # closed; none on a timeout, so a hung Redis costs one socket timeout.
        retry = Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,))
        self._redis = redis.asyncio.Redis.from_url(
            redis_url,
            decode_responses=True,
            socket_timeout=_SOCKET_TIMEOUT_S,
            socket_connect_timeout=_SOCKET_TIMEOUT_S,
            retry=retry,
        )

    async def apply(self, batch: EventBatch) -> ApplyResult:
        change = net_change(batch)
        with self._failures("apply"):
            position, held = await self._read_stream(batch.worker, change.cleared)
            if not continues_stream(position, batch):
                return ApplyResult.RESYNC
            return await self._write(batch, change, position, held)

    async def lookup(self, block_hashes: Sequence[BlockHash], workers: Sequence[str]) -> dict[str, int]:
        with self._failures("lookup"):
            async with self._redis.pipeline(transaction=False) as pipe:
                for block_hash in block_hashes:
                    pipe.smembers(self._keys.block(block_hash.hex()))
                for worker in workers:
                    pipe.exists(self._keys.heartbeat(worker))
                results = await pipe.execute()
        holders, beats = results[: len(block_hashes)], results[len(block_hashes) :]
        return count_leading(holders, workers, [w for w, beat in zip(workers, beats) if beat])

    async def remove_worker(self, worker: str) -> None:
        with self._failures("remove_worker"):
            while not await self._forget(worker, only_if_dead=False):
                pass  # a batch of this worker was applied meanwhile: read its blocks again

    async def purge_dead(self) -> list[str]:
        with self._failures("purge_dead"):
            workers = sorted(_decoded(await self._redis.smembers(self._keys.workers)))
            async with self._redis.pipeline(transaction=False) as pipe:
                for worker in workers:
                    pipe.exists(self._keys.heartbeat(worker))
                beats = await pipe.execute()
            dead = [w for w, beat in zip(workers, beats) if not beat]
            return [w for w in dead if await self._forget(w, only_if_dead=True)]

    async def blocks_of(self, worker: str) -> set[BlockHash]:
        with self._failures("blocks_of"):
            hexes = _decoded(await self._redis.smembers(self._keys.blocks(worker)))
        return {BlockHash(bytes.fromhex(h)) for h in hexes}

    async def close(self) -> None:
        await self._redis.aclose()

    async def _read_stream(self, worker: str, cleared: bool) -> tuple[StreamPosition | None, set[str]]:
        """The worker's stream position, and its hash hexes when the batch drops them (else empty)."""
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.hmget(self._keys.state(worker), ["instance", "seq"])
            if cleared:
                pipe.smembers(self._keys.blocks(worker))
            results = await pipe.execute()
        return _position(results[0]), set(results[1]) if cleared else set()

    async def _write(
        self, batch: EventBatch, change: BlockChange, position: StreamPosition | None, held: set[str]
    ) -> ApplyResult:
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hmget(self._keys.state(batch.worker), ["instance", "seq"])
            self._queue_changes(pipe, batch.worker, change, held)
            self._queue_position(pipe, batch)
            found = _position((await pipe.execute())[0])
        if batch.snapshot is None and found != position:
            # purge_dead or remove_worker ran between our read and this write, so the batch landed on
            # an emptied worker: drop its position to force a snapshot. (A snapshot replaces anyway.)
            await self._redis.delete(self._keys.state(batch.worker))
            return ApplyResult.RESYNC
        return ApplyResult.APPLIED

    def _queue_changes(self, pipe: Pipeline, worker: str, change: BlockChange, held: set[str]) -> None:
        added = {h.hex() for h in change.added}
        removed = held - added if change.cleared else {h.hex() for h in change.removed}
        for hash_hex in removed:
            pipe.srem(self._keys.block(hash_hex), worker)
        for hash_hex in added:  # all of them, not only new ones: a purge may have run since the read
            pipe.sadd(self._keys.block(hash_hex), worker)
        if removed:
            pipe.srem(self._keys.blocks(worker), *removed)
        if added:
            pipe.sadd(self._keys.blocks(worker), *added)

    def _queue_position(self, pipe: Pipeline, batch: EventBatch) -> None:
        pipe.hset(self._keys.state(batch.worker), mapping={"instance": batch.instance, "seq": batch.seq})
        pipe.set(self._keys.heartbeat(batch.worker), batch.instance, px=max(1, round(self.heartbeat_ttl_s * 1000)))
        pipe.sadd(self._keys.workers, batch.worker)

    async def _forget(self, worker: str, only_if_dead: bool) -> bool:
        """Delete everything about worker; False if a batch was applied meanwhile (or it is alive)."""
        keys = self._keys
        async with self._redis.pipeline(transaction=True) as pipe:
            await pipe.watch(keys.state(worker), keys.blocks(worker), keys.heartbeat(worker))
            if only_if_dead and await pipe.exists(keys.heartbeat(worker)):
                return False
            held = _decoded(await pipe.smembers(keys.blocks(worker)))
            pipe.multi()
            for hash_hex in held:
                pipe.srem(keys.block(hash_hex), worker)
            pipe.delete(keys.blocks(worker), keys.state(worker), keys.heartbeat(worker))
            pipe.srem(keys.workers, worker)
            try:
                await pipe.execute()
            except redis.WatchError:
                return False
        return True

    @contextlib.contextmanager
    def _failures(self, operation: str) -> Iterator[None]:
        try:
            yield
        except _ERRORS as e:
            raise IndexUnavailable(f"redis index at {self._where}: {operation} failed: {type(e).__name__}: {e}") from e


def _position(fields: list[str | None]) -> StreamPosition | None:
    instance, seq = fields
    return None if instance is None or seq is None else StreamPosition(instance, int(seq))


def _without_password(url: str) -> str:
    """The URL for messages, without user and password."""
    parts = urlsplit(url)
    return urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))
