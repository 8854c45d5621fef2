"""The prefix index contract: which live worker holds which KV blocks, kept from the workers' own
block-pool events. Two backends behind it (memory: the embedded default; redis: --redis-url),
both checked by the same contract tests (tests/unit/gateway/test_kv_index.py).

Protocol with a worker (one writer per worker: the gateway that worker publishes to):
- A worker publishes EventBatches with seq 1, 2, 3, ... under an instance id that changes when the
  worker restarts. Empty batches are heartbeats.
- apply() applies a batch only if it continues the worker's known stream (same instance, seq ==
  last seq + 1); otherwise (a gap: lost batch; a new instance: restarted worker; no state: the index
  or Redis restarted) it changes nothing and returns RESYNC. The worker then sends a snapshot: a
  batch whose `snapshot` lists every hash it holds, which replaces what the index has for it and
  restarts the stream at that batch's seq. So the index converges to the workers' pools.
- Every applied batch refreshes the worker's heartbeat (TTL heartbeat_ttl_s). Lookups ignore
  workers whose heartbeat expired; purge_dead() deletes their blocks.
- Backend failures raise IndexUnavailable (callers fall back to load-only routing).
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass

from splitserve.common.block_hash import BlockHash
from splitserve.common.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent


@dataclass(frozen=True, slots=True)
class EventBatch:
    worker: str  # the worker's address (its stable id in the index)
    instance: str  # changes when the worker process restarts
    seq: int  # >= 1, +1 per batch of this instance
    events: tuple[KVCacheEvent, ...] = ()
    snapshot: tuple[BlockHash, ...] | None = None  # set: every hash the worker holds now (replaces)


@dataclass(frozen=True, slots=True)
class StreamPosition:
    """Where the index is in one worker's stream: the last applied batch."""

    instance: str
    seq: int


def continues_stream(position: StreamPosition | None, batch: EventBatch) -> bool:
    """Whether apply() takes batch: a snapshot always; other batches only right after position."""
    if batch.snapshot is not None:
        return True
    return position is not None and position.instance == batch.instance and batch.seq == position.seq + 1


@dataclass(frozen=True, slots=True)
class BlockChange:
    """A batch's net effect on one worker's hashes: drop all if cleared (else the removed), then add."""

    cleared: bool
    added: frozenset[BlockHash]
    removed: frozenset[BlockHash]


def net_change(batch: EventBatch) -> BlockChange:
    """The snapshot first (it replaces), then the events in order, so a hash's last event wins."""
    cleared = batch.snapshot is not None
    added, removed = set(batch.snapshot or ()), set[BlockHash]()
    for event in batch.events:
        if isinstance(event, BlockStored):
            added.update(event.block_hashes)
            removed.difference_update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            removed.update(event.block_hashes)
            added.difference_update(event.block_hashes)
        elif isinstance(event, AllBlocksCleared):
            cleared = True
            added.clear()
            removed.clear()
    return BlockChange(cleared, frozenset(added), frozenset(removed))


def count_leading(holders: Iterable[Collection[str]], workers: Sequence[str], alive: Collection[str]) -> dict[str, int]:
    """lookup()'s answer from the holders of each block hash, in order (stops once nobody is left)."""
    counts = dict.fromkeys(workers, 0)
    running = {w for w in workers if w in alive}
    for holding in holders:
        running.intersection_update(holding)
        if not running:
            break
        for worker in running:
            counts[worker] += 1
    return counts


class ApplyResult(enum.Enum):
    APPLIED = "applied"
    RESYNC = "resync"  # not applied: send a snapshot


class IndexUnavailable(Exception):
    """The backend cannot be reached or failed; the message says why."""


class KVIndex(ABC):
    name: str

    def __init__(self, namespace: str, heartbeat_ttl_s: float = 5.0) -> None:
        self.namespace = namespace  # model and block size, so two models never mix
        self.heartbeat_ttl_s = heartbeat_ttl_s

    @abstractmethod
    async def apply(self, batch: EventBatch) -> ApplyResult:
        """Apply one batch (see the module docstring for when it is refused)."""

    @abstractmethod
    async def lookup(self, block_hashes: Sequence[BlockHash], workers: Sequence[str]) -> dict[str, int]:
        """For each of workers that is alive, how many leading block_hashes it holds (0 if none)."""

    @abstractmethod
    async def remove_worker(self, worker: str) -> None:
        """Forget a worker and its blocks (it deregistered)."""

    @abstractmethod
    async def purge_dead(self) -> list[str]:
        """Delete the blocks of workers whose heartbeat expired; returns those workers."""

    @abstractmethod
    async def blocks_of(self, worker: str) -> set[BlockHash]:
        """Every hash the index holds for worker (tests and debugging)."""

    async def close(self) -> None:
        """Release connections."""


_BACKENDS: dict[str, Callable[..., KVIndex]] = {}  # the classes; the redis one also takes redis_url


def register_index(cls: type[KVIndex]) -> type[KVIndex]:
    _BACKENDS[cls.name] = cls
    return cls


def index_backends() -> list[str]:
    return sorted(_BACKENDS)


def make_index(namespace: str, redis_url: str | None = None, heartbeat_ttl_s: float = 5.0) -> KVIndex:
    """The Redis index when a URL is given, else the in-memory one."""
    if redis_url:
        return _BACKENDS["redis"](namespace, redis_url=redis_url, heartbeat_ttl_s=heartbeat_ttl_s)
    return _BACKENDS["memory"](namespace, heartbeat_ttl_s=heartbeat_ttl_s)
