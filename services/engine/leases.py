"""Leases on the blocks a prefill-tier request keeps for its decode worker.

A finished prefill-tier request keeps its prompt blocks (scheduler.held) until they are sent. The
lease bounds that wait: the sender claims the blocks when it starts reading them (from then on
only the sender releases them, after the send); blocks nobody claims within `lease_s` go back to
the pool. An abort before the claim releases them at once. So neither a cancelled Prefill RPC
nor a decode worker that never asks can pin blocks for longer than the lease (llm-d keeps
prefill-side KV under the same kind of lease).

Thread-safe: the sender claims from the event loop the moment the first token is out, without
waiting for the step thread (which may be in the next prompt's forward, seconds on a CPU); the step
thread starts, expires and (on abort) claims. Exactly one of the claim, an abort and an expiry wins.
"""

from __future__ import annotations

import threading
import time


class HeldLeases:
    def __init__(self, lease_s: float) -> None:
        self.lease_s = lease_s
        self._deadlines: dict[str, float] = {}  # unclaimed held requests -> monotonic deadline
        self._lock = threading.Lock()
        self.num_expired = 0  # cumulative, for metrics

    def start(self, request_id: str, now: float | None = None) -> None:
        with self._lock:
            self._deadlines[request_id] = (time.monotonic() if now is None else now) + self.lease_s

    def claim(self, request_id: str) -> bool:
        """The sender takes the blocks; False if the lease is gone (expired, aborted or never started)."""
        with self._lock:
            return self._deadlines.pop(request_id, None) is not None

    def drop(self, request_id: str) -> None:
        """The blocks are released by other means (sent, failed, aborted): no deadline any more."""
        with self._lock:
            self._deadlines.pop(request_id, None)

    def expire(self, now: float | None = None) -> list[str]:
        """Unclaimed leases past their deadline, removed (their blocks are the caller's to free)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            expired = [rid for rid, deadline in self._deadlines.items() if deadline <= now]
            for rid in expired:
                del self._deadlines[rid]
            self.num_expired += len(expired)
        return expired

    def next_deadline(self) -> float | None:
        with self._lock:
            return min(self._deadlines.values(), default=None)

    def __len__(self) -> int:
        return len(self._deadlines)
