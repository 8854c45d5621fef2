"""A worker's KV handoff metrics, counted where the handoffs run: in its engine core process. The
worker's registry exports them with its own (services/worker/metrics.py CoreMetrics reads the core's
exposition at each scrape), so nothing relays them event by event."""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram

from splitserve.common.serving import LATENCY_BUCKETS, METRIC_PREFIX
from splitserve.services.disagg.transfer.base import TransferFailure

DIRECTIONS = {"prefill": "sent", "decode": "received"}  # role -> the direction of its KV transfers


class KVTransferMetrics:
    """What a prefill worker's sends (services/disagg/prefill.py) and a decode worker's handoffs
    (services/disagg/decode.py) count, in the engine core."""

    def __init__(self, labels: Mapping[str, str], role: str, registry: CollectorRegistry) -> None:
        """labels: the worker's (model_name, role), on every series; role: what the worker does."""
        self.labels = dict(labels)
        names = list(self.labels)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(METRIC_PREFIX + name, doc, names + list(extra), registry=registry)

        self.kv_bytes = counter("kv_transfer_bytes", "KV bytes moved between tiers.", ("direction",))
        self.kv_blocks = counter("kv_transfer_blocks", "KV blocks moved between tiers.", ("direction",))
        self.kv_rank_bytes = counter(
            "kv_transfer_rank_bytes",
            "KV bytes moved between tiers by each tensor-parallel rank of this worker (its own KV heads).",
            ("direction", "rank"),
        )
        self.kv_seconds = Histogram(
            METRIC_PREFIX + "kv_transfer_seconds",
            "Time of one KV transfer.",
            names + ["direction"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.kv_failures = counter("kv_transfer_failures", "Failed KV handoffs, by reason.", ("reason",))
        self.kv_skipped = counter(
            "kv_transfer_blocks_skipped", "Prompt blocks not transferred because the decode worker held them."
        )
        self.kv_recomputes = counter(
            "kv_transfer_recompute_fallbacks",
            "Requests whose prompt was recomputed on the decode worker after a failed transfer.",
        )
        self.kv_streamed = counter(
            "kv_transfers_streamed",
            "KV sends that went out layer by layer while the prompt's last step computed (prefill).",
        )
        self._start_at_zero(DIRECTIONS.get(role))

    def _start_at_zero(self, direction: str | None) -> None:
        """Create every series this worker can report, at zero, so that a rate() over a series
        that only moves on failure (or that moved before the first scrape) has data from the start."""
        lab = self.labels
        for c in (self.kv_skipped, self.kv_recomputes, self.kv_streamed):
            self._series(c)
        if direction is not None:
            self.kv_seconds.labels(**lab, direction=direction)
            for c in (self.kv_bytes, self.kv_blocks):
                c.labels(**lab, direction=direction)
        for reason in TransferFailure:
            self.kv_failures.labels(**lab, reason=reason.value)

    def _series(self, counter: Counter) -> Counter:
        """The worker's series of a counter with no labels of its own (the counter itself if the
        worker has no labels either: a core made without them, in tests)."""
        return counter.labels(**self.labels) if self.labels else counter

    def observe_transfer(self, direction: str, num_blocks: int, num_bytes: int, seconds: float) -> None:
        self.kv_bytes.labels(**self.labels, direction=direction).inc(num_bytes)
        self.kv_blocks.labels(**self.labels, direction=direction).inc(num_blocks)
        self.kv_seconds.labels(**self.labels, direction=direction).observe(seconds)

    def observe_rank_bytes(self, direction: str, rank: int, num_bytes: int) -> None:
        self.kv_rank_bytes.labels(**self.labels, direction=direction, rank=str(rank)).inc(num_bytes)

    def observe_transfer_failure(self, reason: TransferFailure) -> None:
        self.kv_failures.labels(**self.labels, reason=reason.value).inc()

    def observe_blocks_skipped(self, num_blocks: int) -> None:
        self._series(self.kv_skipped).inc(num_blocks)

    def observe_streamed_send(self) -> None:
        self._series(self.kv_streamed).inc()

    def observe_recompute_fallback(self) -> None:
        self._series(self.kv_recomputes).inc()
