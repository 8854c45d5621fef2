"""asyncio front of the engine: one async generator per request; cancelling it aborts the request.

Only the background loop touches the Engine: callers validate in their own task (pure), then hand
adds and aborts to the loop, which applies them between steps and runs each step in a thread.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from splitserve.services.config import EngineConfig
from splitserve.services.engine.engine import Engine, PromptInput, RequestOutput, merge_outputs
from splitserve.services.engine.request import Request
from splitserve.services.engine.sampling_params import SamplingParams


class AsyncEngine:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._pending_adds: list[Request] = []
        self._pending_aborts: list[str] = []
        self._streams: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._wakeup = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        self._error: BaseException | None = None

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncEngine:
        return cls(Engine(config))

    async def generate(self, prompt: PromptInput, params: SamplingParams, request_id: str | None = None,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        if self._error is not None:
            raise RuntimeError(f"the engine loop died: {self._error!r}")
        request = self.engine.make_request(prompt, params, request_id, priority)  # raises ValueError
        rid = request.request_id
        if rid in self._streams:
            raise ValueError(f"request id {rid!r} is already in use")
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._streams[rid] = queue
        self._pending_adds.append(request)
        self._ensure_loop()
        finished = False
        try:
            while not finished:
                item = await queue.get()
                while not isinstance(item, BaseException) and not item.finished and not queue.empty():
                    nxt = queue.get_nowait()  # the consumer fell behind: send one merged chunk
                    item = nxt if isinstance(nxt, BaseException) else merge_outputs(item, nxt)
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._streams.pop(rid, None)
            if not finished:  # consumer cancelled or stopped early: free the request's blocks
                self.abort(rid)

    def abort(self, request_id: str) -> None:
        self._pending_aborts.append(request_id)
        self._wakeup.set()

    def num_requests(self) -> int:
        return len(self._streams)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._streams

    def _ensure_loop(self) -> None:
        if self._loop_task is None or self._loop_task.done():
            self._loop_task = asyncio.get_running_loop().create_task(self._run())
        self._wakeup.set()

    async def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                self._apply_pending()
                if not engine.has_unfinished_requests():
                    self._wakeup.clear()
                    await self._wakeup.wait()
                    continue
                outputs = await asyncio.to_thread(engine.step)
                for out in outputs:
                    queue = self._streams.get(out.request_id)
                    if queue is not None:
                        queue.put_nowait(out)
        except Exception as e:  # surface to every waiting stream instead of hanging them
            self._error = e
            for queue in self._streams.values():
                queue.put_nowait(e)
            raise

    def _apply_pending(self) -> None:
        adds, self._pending_adds = self._pending_adds, []
        for request in adds:
            if request.request_id in self._streams:
                self.engine.add_request(request)
        aborts, self._pending_aborts = self._pending_aborts, []
        for rid in aborts:
            self.engine.abort_request(rid)

    async def shutdown(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            try:
                await self._loop_task
            except (asyncio.CancelledError, Exception):
                pass
