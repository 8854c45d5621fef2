"""The embedded prefix index: plain dicts in the gateway process (the default, no Redis).

State dies with the gateway; the first batch each worker sends afterwards is refused (no stream
position), so every worker resyncs with a snapshot.
"""

from __future__ import annotations

import time
from collections.abc import Sequence, Set

from splitserve.common.block_hash import BlockHash
from splitserve.gateway.kv_index.base import (
    ApplyResult,
    EventBatch,
    KVIndex,
    StreamPosition,
    continues_stream,
    count_leading,
    net_change,
    register_index,
)


@register_index
class MemoryIndex(KVIndex):
    name = "memory"

    def __init__(self, namespace: str, heartbeat_ttl_s: float = 5.0) -> None:
        super().__init__(namespace, heartbeat_ttl_s)
        self._holders: dict[BlockHash, set[str]] = {}  # hash -> workers holding it
        self._blocks: dict[str, set[BlockHash]] = {}  # worker -> hashes it holds
        self._positions: dict[str, StreamPosition] = {}
        self._expiry: dict[str, float] = {}  # worker -> time.monotonic() its heartbeat runs out

    async def apply(self, batch: EventBatch) -> ApplyResult:
        if not continues_stream(self._positions.get(batch.worker), batch):
            return ApplyResult.RESYNC
        change = net_change(batch)
        held = self._blocks.get(batch.worker, set())
        self._drop(batch.worker, held - change.added if change.cleared else change.removed)
        self._add(batch.worker, change.added)
        self._positions[batch.worker] = StreamPosition(batch.instance, batch.seq)
        self._expiry[batch.worker] = time.monotonic() + self.heartbeat_ttl_s
        return ApplyResult.APPLIED

    async def lookup(self, block_hashes: Sequence[BlockHash], workers: Sequence[str]) -> dict[str, int]:
        now = time.monotonic()
        alive = [w for w in workers if self._alive(w, now)]
        return count_leading((self._holders.get(h, ()) for h in block_hashes), workers, alive)

    async def remove_worker(self, worker: str) -> None:
        self._drop(worker, self._blocks.get(worker, set()))
        self._positions.pop(worker, None)
        self._expiry.pop(worker, None)

    async def purge_dead(self) -> list[str]:
        now = time.monotonic()
        dead = [w for w in self._expiry if not self._alive(w, now)]
        for worker in dead:
            await self.remove_worker(worker)
        return dead

    async def blocks_of(self, worker: str) -> set[BlockHash]:
        return set(self._blocks.get(worker, ()))

    def _alive(self, worker: str, now: float) -> bool:
        return self._expiry.get(worker, now) > now

    # Both touch only the hashes a batch changes, not everything the worker holds.
    def _add(self, worker: str, hashes: Set[BlockHash]) -> None:
        for block_hash in hashes:
            self._holders.setdefault(block_hash, set()).add(worker)
        if hashes:
            self._blocks.setdefault(worker, set()).update(hashes)

    def _drop(self, worker: str, hashes: Set[BlockHash]) -> None:
        held = self._blocks.get(worker, set())
        for block_hash in hashes & held:
            holders = self._holders[block_hash]
            holders.discard(worker)
            if not holders:  # drop empty sets so the dict does not keep every hash ever seen
                del self._holders[block_hash]
        held.difference_update(hashes)
        if not held:
            self._blocks.pop(worker, None)
