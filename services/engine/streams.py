"""Per-request output streams on the event loop: an engine core's outputs arrive once per step
(services/engine/core_client.py) and wait in one mailbox per request until its consumer reads them.
A consumer that falls behind reads one merged output; one that leaves early aborts its request."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncGenerator, Callable
from typing import Any

from splitserve.services.engine.outputs import RequestOutput, merge_outputs


class RequestFailed(RuntimeError):
    """The engine failed while running this request (it was stopped, its blocks freed)."""


class Streams:
    def __init__(self, abort: Callable[[str], None]) -> None:
        self._abort = abort  # stops a request whose consumer left before it finished
        self._mailboxes: dict[str, _Mailbox] = {}
        self._labels: dict[str, str] = {}  # request id -> the client's id (for Abort by that id)
        self.error: BaseException | None = None  # the engine died: every stream ends with it

    def open(self, request_id: str, label: str = "") -> None:
        """Claim request_id and start collecting its outputs (read() yields them)."""
        if self.error is not None:
            raise self.error
        if request_id in self._mailboxes:
            raise ValueError(f"request id {request_id!r} is already in use")
        self._mailboxes[request_id] = _Mailbox()
        self._labels[request_id] = label

    async def read(self, request_id: str) -> AsyncGenerator[RequestOutput, None]:
        """Outputs of an opened request until it finishes; leaving early aborts it."""
        mailbox = self._mailboxes[request_id]
        finished = False
        try:
            while not finished:
                item = await mailbox.get()
                while not isinstance(item, BaseException) and not item.finished and mailbox.items:
                    nxt = mailbox.items.popleft()  # the consumer fell behind: send one merged chunk
                    item = nxt if isinstance(nxt, BaseException) else merge_outputs(item, nxt)
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            self.close(request_id, finished)

    def close(self, request_id: str, finished: bool) -> None:
        self._mailboxes.pop(request_id, None)
        self._labels.pop(request_id, None)
        if not finished:  # consumer cancelled or stopped early: free the request's blocks
            self._abort(request_id)

    def dispatch(self, outputs: list[RequestOutput]) -> None:
        """One step's outputs into their streams (one event-loop callback per step)."""
        for out in outputs:
            mailbox = self._mailboxes.get(out.request_id)
            if mailbox is not None:
                mailbox.put(RequestFailed(out.error) if out.error is not None else out)

    def fail(self, request_id: str, error: BaseException) -> None:
        """End one stream with error (raised to its consumer)."""
        mailbox = self._mailboxes.get(request_id)
        if mailbox is not None:
            mailbox.put(error)

    def fail_all(self, error: BaseException) -> None:
        """The engine died: every stream ends with error, and new ones are refused."""
        self.error = error
        for mailbox in self._mailboxes.values():
            mailbox.put(error)

    def abort_label(self, label: str) -> int:
        """Abort every open request carrying the client's id label; returns how many."""
        request_ids = [rid for rid, lab in self._labels.items() if lab == label]
        for request_id in request_ids:
            self._abort(request_id)
        return len(request_ids)

    def __len__(self) -> int:
        return len(self._mailboxes)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._mailboxes


def post_to_loop(loop: asyncio.AbstractEventLoop, fn: Callable, *args: Any) -> None:
    """From another thread: run fn(*args) on the event loop (dropped once the loop is closed: nobody
    is listening any more)."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        pass


def answer_call(loop: asyncio.AbstractEventLoop, future: asyncio.Future, fn: Callable, args: tuple) -> None:
    """On the step thread: run a call unless its caller stopped waiting, and resolve its future."""
    if future.cancelled():
        return
    try:
        result = fn(*args)
    except Exception as e:  # the caller gets it; the loop goes on
        post_to_loop(loop, set_exception, future, e)
    else:
        post_to_loop(loop, set_result, future, result)


def set_result(future: asyncio.Future, result: Any) -> None:
    if not future.done():
        future.set_result(result)


def set_exception(future: asyncio.Future, error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)


class _Mailbox:
    """One stream's outputs on their way to its consumer, on the event loop only: what asyncio.Queue
    does for this one producer and one consumer, with less work per item (a step at 256 streams
    puts 256; docs/benchmarks.md has the event loop's CPU per step before and after)."""

    __slots__ = ("items", "_waiter")

    def __init__(self) -> None:
        self.items: deque[RequestOutput | BaseException] = deque()
        self._waiter: asyncio.Future[None] | None = None

    def put(self, item: RequestOutput | BaseException) -> None:
        self.items.append(item)
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self) -> RequestOutput | BaseException:
        while not self.items:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        return self.items.popleft()
