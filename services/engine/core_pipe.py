"""One direction of the pipe between a worker's serving process and its engine core: a writer
thread fed by a queue, so that no thread that must keep reading ever blocks on a write.

Why: each direction is a kernel buffer of a few hundred small messages. If the core's command
reader blocked writing a refusal while the serving process read events slowly, it stopped reading
commands; the serving side's event loop then blocked writing an add, and its event reader, going
on, blocked on the event loop's lock to acknowledge a step: neither process read again
(issue 43, item 2). Here `put` never waits for the pipe: the writer thread does.

The queue has a soft capacity: `put` always takes the message (a reader's refusal, an
acknowledgement), while a producer that may wait asks for room first: the core's step loop
(`wait_for_room`, blocking: a serving process that falls behind slows the steps, and the queue
stays bounded) and the serving side's admission of new requests (`has_room`, with `on_room` to
wake an asynchronous waiter).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from multiprocessing.connection import Connection

DEFAULT_CAPACITY = 64  # messages queued before a producer that may wait does


class PipeWriter:
    """The only writer of one direction of a pipe, in the order messages were put."""

    def __init__(
        self,
        conn: Connection,
        name: str,
        on_lost: Callable[[OSError], None],
        capacity: int = DEFAULT_CAPACITY,
    ) -> None:
        """on_lost(error): the other end is gone (called once, on the writer thread); later
        messages are dropped. capacity: the backlog above which has_room is false."""
        self._conn, self._on_lost, self._capacity = conn, on_lost, capacity
        self._queue: deque[bytes] = deque()
        self._changed = threading.Condition()
        self._closing = False
        self._lost = False
        self.on_room: Callable[[], None] | None = None  # called (writer thread) when a full queue gets room
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, data: bytes) -> None:
        """Queue one message; never waits for the pipe."""
        with self._changed:
            if self._lost or self._closing:
                return  # nobody reads it any more (the reader sees the end of the pipe)
            self._queue.append(data)
            self._changed.notify_all()

    def has_room(self) -> bool:
        return len(self._queue) < self._capacity or self._lost

    def wait_for_room(self) -> None:
        """Block while the backlog is at capacity (returns at once once the pipe is lost or closing)."""
        with self._changed:
            self._changed.wait_for(lambda: len(self._queue) < self._capacity or self._lost or self._closing)

    def backlog(self) -> int:
        """Messages not yet written."""
        return len(self._queue)

    def close(self, timeout_s: float | None = None) -> bool:
        """Write what is queued, then stop; True if all of it was written within timeout_s (a reader
        that never reads again leaves the rest)."""
        with self._changed:
            self._closing = True
            self._changed.notify_all()
        self._thread.join(timeout_s)
        return not self._thread.is_alive() and not self._lost

    def _run(self) -> None:
        while (data := self._next()) is not None:
            try:
                self._conn.send_bytes(data)
            except OSError as e:  # the other end closed: its process exited or was killed
                self._lose(e)
                return

    def _next(self) -> bytes | None:
        """The next message to write (waits for one); None once closing and flushed."""
        with self._changed:
            self._changed.wait_for(lambda: self._queue or self._closing)
            if not self._queue:
                return None
            data = self._queue.popleft()
            if len(self._queue) == self._capacity - 1:  # it was full: a waiter may go on
                self._changed.notify_all()
                if self.on_room is not None:
                    self.on_room()
            return data

    def _lose(self, error: OSError) -> None:
        with self._changed:
            self._lost = True
            self._queue.clear()
            self._changed.notify_all()
        self._on_lost(error)
        if self.on_room is not None:  # an admission waiting for room goes on (and finds the engine dead)
            self.on_room()
