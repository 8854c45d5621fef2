"""The gateway's side of the prefix index: takes workers' KV events, hashes prompts with the same
function the workers use, and answers "how many leading prompt blocks does each worker hold?".

When the index backend fails (Redis down), lookups return None and routing falls back to load
only; a log line and `splitserve_gateway_prefix_index_up` say so, and no request fails because of
it. While it is down, requests skip the lookup for RETRY_AFTER_S at a time (so a hung Redis does
not add its timeout to every request); workers' publishes keep probing it meanwhile.

Routed-but-not-yet-published prefixes: a worker publishes a prompt's blocks only once it has
computed them (a 1k-token prefill takes seconds on CPU), so requests sharing a prefix that arrive
meanwhile would find no holder and scatter. The gateway therefore remembers, for ROUTED_TTL_S, the
prompt blocks it just sent to each worker and counts them like indexed ones. Workers' batches refused
meanwhile leave gaps in their sequence numbers, so once the backend is back every worker is asked for a
snapshot and the index converges again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from splitserve.common.block_hash import BlockHash
from splitserve.common.wire import kv_events_from_proto
from splitserve.gateway.kv_index import ApplyResult, EventBatch, IndexUnavailable, KVIndex, make_index
from splitserve.protos.v1 import worker_pb2 as pb

log = logging.getLogger("splitserve.gateway")
RETRY_AFTER_S = 2.0
ROUTED_TTL_S = 30.0
_MATCH_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


class PrefixIndexMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.lookups = Counter(
            "splitserve_gateway_prefix_index_lookups", "Index lookups, by result.", ["result"], registry=registry
        )
        self.matched = Histogram(
            "splitserve_gateway_prefix_matched_blocks",
            "Leading prompt blocks held by the chosen worker.",
            buckets=_MATCH_BUCKETS,
            registry=registry,
        )
        self.errors = Counter(
            "splitserve_gateway_prefix_index_errors",
            "Index backend errors, by operation.",
            ["operation"],
            registry=registry,
        )
        self.resyncs = Counter(
            "splitserve_gateway_prefix_index_resyncs",
            "Snapshots asked of workers (gap, restart, lost index state).",
            registry=registry,
        )
        self.up = Gauge("splitserve_gateway_prefix_index_up", "1 while the index backend answers.", registry=registry)
        self.up.set(1)
        for result in ("ok", "error", "skipped"):  # at zero from the start, so every rate() has a series
            self.lookups.labels(result=result)
        self.purged = Counter(
            "splitserve_gateway_prefix_index_purged_workers",
            "Workers whose blocks the index dropped for a missed heartbeat, by whether the gateway still "
            "had them as registered and healthy (live=true: a heartbeat starved, not a dead worker).",
            ["live"],
            registry=registry,
        )
        for live in ("true", "false"):
            self.purged.labels(live=live)


class PrefixIndex:
    """One KVIndex per (model, block size) namespace, with fallback bookkeeping."""

    def __init__(
        self, model: str, redis_url: str | None, metrics: PrefixIndexMetrics, heartbeat_ttl_s: float = 5.0
    ) -> None:
        self.model, self.redis_url, self.metrics = model, redis_url, metrics
        self.heartbeat_ttl_s = heartbeat_ttl_s
        self._indexes: dict[int, KVIndex] = {}
        self.available = True
        self._down_since = 0.0  # monotonic time of the last failure while unavailable
        self._routed: dict[BlockHash, dict[str, float]] = {}  # hash -> worker -> expiry (monotonic)

    def _index(self, block_size: int) -> KVIndex:
        if block_size not in self._indexes:
            namespace = f"{self.model}:{block_size}"
            self._indexes[block_size] = make_index(namespace, self.redis_url, self.heartbeat_ttl_s)
        return self._indexes[block_size]

    def _mark(self, ok: bool, operation: str, error: Exception | None = None) -> None:
        if not ok:
            self.metrics.errors.labels(operation=operation).inc()
            self._down_since = time.monotonic()
        if ok != self.available:
            if ok:
                log.info("prefix index is back; routing is cache-aware again")
            else:
                log.warning("prefix index unavailable (%s); routing by load only until it returns", error)
            self.available = ok
            self.metrics.up.set(1 if ok else 0)

    async def publish(self, r: pb.PublishKVEventsRequest) -> bool:
        """Apply a worker's batch; True when the worker must send a snapshot next."""
        batch = EventBatch(
            r.address,
            r.instance_id,
            r.seq,
            kv_events_from_proto(r.events),
            tuple(BlockHash(h) for h in r.snapshot_block_hashes) if r.is_snapshot else None,
        )
        try:
            result = await self._index(r.block_size).apply(batch)
        except IndexUnavailable as e:
            self._mark(False, "apply", e)
            return False  # the gap this leaves asks for a snapshot once the backend is back
        self._mark(True, "apply")
        if result is ApplyResult.RESYNC:
            self.metrics.resyncs.inc()
            return True
        return False

    async def matches(
        self, hashes: Sequence[BlockHash], block_size: int, workers: Sequence[str]
    ) -> dict[str, int] | None:
        """Leading prompt blocks each worker holds (indexed, or routed there lately), or None when
        the index cannot answer."""
        if not self.available and time.monotonic() - self._down_since < RETRY_AFTER_S:
            self.metrics.lookups.labels(result="skipped").inc()
            return None
        if not hashes:
            return {w: 0 for w in workers}
        try:
            found = await self._index(block_size).lookup(hashes, workers)
        except IndexUnavailable as e:
            self.metrics.lookups.labels(result="error").inc()
            self._mark(False, "lookup", e)
            return None
        self.metrics.lookups.labels(result="ok").inc()
        self._mark(True, "lookup")
        routed = self._routed_leading(hashes, workers)
        return {w: max(found.get(w, 0), routed[w]) for w in workers}

    def note_routed(self, hashes: Sequence[BlockHash], worker: str) -> None:
        expiry = time.monotonic() + ROUTED_TTL_S
        for h in hashes:
            self._routed.setdefault(h, {})[worker] = expiry

    def _routed_leading(self, hashes: Sequence[BlockHash], workers: Sequence[str]) -> dict[str, int]:
        now = time.monotonic()
        counts = {}
        for w in workers:
            n = 0
            while n < len(hashes) and self._routed.get(hashes[n], {}).get(w, 0.0) > now:
                n += 1
            counts[w] = n
        return counts

    def _expire_routed(self) -> None:
        now = time.monotonic()
        for h in list(self._routed):
            live = {w: t for w, t in self._routed[h].items() if t > now}
            if live:
                self._routed[h] = live
            else:
                del self._routed[h]

    async def remove_worker(self, address: str) -> None:
        for index in self._indexes.values():
            try:
                await index.remove_worker(address)
            except IndexUnavailable as e:
                self._mark(False, "remove", e)

    async def run_purge(self, is_live: Callable[[str], bool] = lambda address: False) -> None:
        """Drop blocks of workers whose heartbeat expired, every heartbeat TTL. is_live(address): whether
        the gateway still counts that worker as registered and healthy (for the purge metric)."""
        while True:
            await asyncio.sleep(self.heartbeat_ttl_s)
            self._expire_routed()
            for index in list(self._indexes.values()):
                try:
                    dead = await index.purge_dead()
                except IndexUnavailable as e:
                    self._mark(False, "purge", e)
                    continue
                for address in dead:
                    live = is_live(address)
                    self.metrics.purged.labels(live=str(live).lower()).inc()
                    log.log(
                        logging.WARNING if live else logging.INFO,
                        "prefix index: purged the blocks of %s (no heartbeat for %.0f s%s)",
                        address,
                        self.heartbeat_ttl_s,
                        "; it is still registered and healthy: its heartbeats were starved" if live else "",
                    )

    async def close(self) -> None:
        for index in self._indexes.values():
            await index.close()
