"""asyncio front of the engine: one async generator per request; cancelling it aborts the request.

Only the background loop touches the Engine: callers validate in their own task (pure), then hand
adds and aborts to the loop, which applies them between steps and runs each step on one thread
(bound to the engine's device).

A request the step failed for ends its stream with RequestFailed; the loop goes on. If the loop
itself dies (the engine's state can no longer be trusted), every stream gets the error, new
requests are refused, and `died` is set so the server can leave the cluster and exit.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from splitserve.common.sampling_params import SamplingParams
from splitserve.engine.config import EngineConfig
from splitserve.engine.engine import Engine, PromptInput, RequestOutput, merge_outputs
from splitserve.engine.model_runner import bind_thread
from splitserve.engine.request import Request

T = TypeVar("T")
log = logging.getLogger("splitserve.engine")


class RequestFailed(RuntimeError):
    """The engine failed while running this request (it was stopped, its blocks freed)."""


class EngineDead(RuntimeError):
    """The engine loop died: this engine runs nothing more (retry elsewhere)."""


class AsyncEngine:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        # Adds, aborts and calls, applied in order between steps by the loop.
        self._pending: list[tuple[Callable, tuple, asyncio.Future | None]] = []
        self._streams: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._labels: dict[str, str] = {}  # request id -> the client's id (for Abort by that id)
        self._wakeup = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        self._error: EngineDead | None = None
        self.died = asyncio.Event()  # the loop raised: this engine serves nothing more
        # Every step runs on this one thread, bound to the engine's device for its life: Triton launches
        # on the calling thread's current CUDA device, and pool threads start on device 0.
        self._step_thread = ThreadPoolExecutor(
            1, thread_name_prefix="engine-step", initializer=bind_thread, initargs=(engine.runner.device,)
        )

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncEngine:
        return cls(Engine(config))

    async def generate(
        self,
        prompt: PromptInput,
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
        label: str = "",
    ) -> AsyncIterator[RequestOutput]:
        # raises ValueError; prefill-tier requests come from HandoffPort.make_prefill_request
        request = self.engine.make_request(prompt, params, request_id, priority, label=label)
        async for out in self.generate_request(request):
            yield out

    def make_request(self, prompt: PromptInput, params: SamplingParams, priority: int = 0, label: str = "") -> Request:
        """A validated request named by the engine (pure: safe from any task)."""
        return self.engine.make_request(prompt, params, priority=priority, label=label)

    async def generate_request(self, request: Request) -> AsyncIterator[RequestOutput]:
        """Add a validated request and stream its outputs."""
        self.open_stream(request.request_id, request.label)
        self._pending.append((self._add, (request,), None))
        self._ensure_loop()
        async for out in self.stream(request.request_id):
            yield out

    def open_stream(self, request_id: str, label: str = "") -> None:
        """Claim request_id and start collecting its step outputs (stream() reads them)."""
        if self._error is not None:
            raise self._error
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        self._streams[request_id] = asyncio.Queue()
        self._labels[request_id] = label

    async def stream(self, request_id: str) -> AsyncIterator[RequestOutput]:
        """Outputs of an opened request until it finishes; leaving early aborts it."""
        queue = self._streams[request_id]
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
            self.close_stream(request_id, finished)

    def close_stream(self, request_id: str, finished: bool) -> None:
        self._streams.pop(request_id, None)
        self._labels.pop(request_id, None)
        if not finished:  # consumer cancelled or stopped early: free the request's blocks
            self.abort(request_id)

    async def call(self, fn: Callable[..., T], *args) -> T:
        """Run fn(*args) on the engine between steps (the only safe time to touch engine state)."""
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._pending.append((fn, args, future))
        self._ensure_loop()
        return await future

    def abort(self, request_id: str) -> None:
        self._pending.append((self.engine.abort_request, (request_id,), None))
        self._wakeup.set()

    def abort_label(self, label: str) -> int:
        """Abort every request carrying the client's id label; returns how many."""
        request_ids = [rid for rid, lab in self._labels.items() if lab == label]
        for rid in request_ids:
            self.abort(rid)
        return len(request_ids)

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
                engine.expire_leases()
                if not engine.has_work():
                    await self._idle()
                    continue
                outputs = await asyncio.get_running_loop().run_in_executor(self._step_thread, engine.step)
                for out in outputs:
                    queue = self._streams.get(out.request_id)
                    if queue is not None:
                        queue.put_nowait(RequestFailed(out.error) if out.error is not None else out)
        except Exception as e:  # surface to every waiting stream instead of hanging them
            self._error = EngineDead(
                f"this worker's engine loop died ({type(e).__name__}: {e}); retry the request on another worker"
            )
            log.exception("the engine loop died")  # the server reads `died`, leaves the cluster, exits
            for queue in self._streams.values():
                queue.put_nowait(self._error)
            self.died.set()

    async def _idle(self) -> None:
        """Wait for new work, waking for the next held-block lease to expire."""
        self._wakeup.clear()
        deadline = self.engine.leases.next_deadline()
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic()) + 0.01
        try:
            await asyncio.wait_for(self._wakeup.wait(), timeout)
        except TimeoutError:
            pass

    def _add(self, request: Request) -> None:
        if request.request_id in self._streams:  # not cancelled before it got here
            self.engine.add_request(request)

    def _apply_pending(self) -> None:
        pending, self._pending = self._pending, []
        for fn, args, future in pending:
            if future is None:
                fn(*args)
                continue
            if future.cancelled():
                continue
            try:
                future.set_result(fn(*args))
            except Exception as e:  # the caller gets it; the loop goes on
                future.set_exception(e)

    async def shutdown(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            try:
                await self._loop_task
            except (asyncio.CancelledError, Exception):
                pass
        self._step_thread.shutdown(wait=False)  # a step still running finishes, then the thread ends
