"""The choices of one HTTP request as one stream, and stopping work when the client goes away.

An HTTP answer commits to its status with its first byte, so a request's streams are started
first: every choice has its first response (or the request fails with a proper status: 400, 429,
503) before any header goes out. After that an error can only travel inside the stream.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import aclosing, suppress
from typing import TypeVar

from starlette.types import Receive

from splitserve.protos.v1 import generation_pb2 as gen_pb

T = TypeVar("T")
Indexed = tuple[int, gen_pb.GenerateResponse]  # (choice index, one of its responses)
Stream = AsyncGenerator[gen_pb.GenerateResponse, None]  # one choice's (GenerationCore.generate)


async def started(streams: list[Stream]) -> AsyncGenerator[Indexed, None]:
    """The merged streams, returned once each has its first response; raises what a stream raised before."""
    merged = merge(streams)
    firsts: list[Indexed] = []
    seen: set[int] = set()
    try:
        while len(seen) < len(streams):
            item = await anext(merged, None)
            if item is None:  # every stream ended (each ends with a response, so not before its first)
                break
            firsts.append(item)
            seen.add(item[0])
    except BaseException:
        await merged.aclose()
        raise
    return _chain(firsts, merged)


async def _chain(firsts: list[Indexed], rest: AsyncGenerator[Indexed, None]) -> AsyncGenerator[Indexed, None]:
    async with aclosing(rest):
        for item in firsts:
            yield item
        async for item in rest:
            yield item


async def merge(streams: list[Stream]) -> AsyncGenerator[Indexed, None]:
    """Responses of all streams as they come; the first error ends it (and the other streams)."""
    if len(streams) == 1:  # the common case: no task, no queue
        async with aclosing(streams[0]) as only:
            async for response in only:
                yield 0, response
        return
    queue: asyncio.Queue[tuple[int, gen_pb.GenerateResponse | asyncio.Task]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[gen_pb.GenerateResponse]) -> None:
        async for response in stream:
            queue.put_nowait((index, response))

    def on_end(index: int) -> Callable[[asyncio.Task], None]:
        return lambda task: queue.put_nowait((index, task))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    for i, task in enumerate(tasks):  # its end (or its error) comes through the queue, after its responses
        task.add_done_callback(on_end(i))
    try:
        running = len(tasks)
        while running:
            index, item = await queue.get()
            if isinstance(item, asyncio.Task):
                item.result()  # raises what the stream raised
                running -= 1
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()  # no await: cancellation reaches each worker call on the task's next step


async def cancel_on_disconnect(receive: Receive, work: Awaitable[T]) -> tuple[T] | None:
    """(work's result,), or None if the client disconnected first, which cancels work: the worker
    calls under it end, and the workers abort the requests and free their KV blocks."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with suppress(asyncio.CancelledError):
                await task
    return (task.result(),) if not task.cancelled() else None


async def _disconnected(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
