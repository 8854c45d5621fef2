"""The order in which transfers on one NCCL channel are issued.

NCCL point-to-point ignores tags: the k-th send a rank issues to a peer meets the k-th receive that
peer issues. So both ends of a channel issue its transfers in one agreed order, the receiver's: the
tags it hands out on the channel (1, 2, 3, ...), which every handoff carries to the sender. Each
side issues transfer t only once it has issued t - 1; the wait is bounded, so a tag that never
comes (its handoff failed on the other side) fails the transfers behind it with a timeout, and the
channel is dropped and rebuilt like any timed-out one. gloo channels need none of this: their
chunks carry the tag (chunks.py).

Waits happen on the transport's worker threads (each transfer already runs on one).
"""

from __future__ import annotations

import threading
import time


class OrderTimeout(Exception):
    """An earlier tag on the channel was not issued in time."""


class IssueOrder:
    """One channel's turn: issue(tag) runs when every lower tag has been issued (or skipped)."""

    def __init__(self, first_tag: int = 1) -> None:
        self._next = first_tag
        self._ready = threading.Condition()
        self._broken = False

    @property
    def next_tag(self) -> int:
        return self._next

    def wait_turn(self, tag: int, timeout_s: float) -> None:
        """Block until tag's turn; OrderTimeout past timeout_s or once the order is broken."""
        deadline = time.monotonic() + timeout_s
        with self._ready:
            while self._next != tag:
                left = deadline - time.monotonic()
                if self._broken or tag < self._next or left <= 0:
                    raise OrderTimeout(self._describe(tag))
                self._ready.wait(left)

    def issued(self, tag: int) -> None:
        """Tag has been issued (or will never be: skipped); the next one may go."""
        with self._ready:
            if tag == self._next:
                self._next += 1
                self._ready.notify_all()

    def break_order(self) -> None:
        """The channel failed: every waiter gives up at once."""
        with self._ready:
            self._broken = True
            self._ready.notify_all()

    def _describe(self, tag: int) -> str:
        if self._broken:
            return f"transfer {tag}: its channel failed while it waited for its turn"
        if tag < self._next:
            return f"transfer {tag} came after its turn (the channel is at {self._next})"
        return f"transfer {tag} waited for transfer {self._next} on its channel, which never came"
