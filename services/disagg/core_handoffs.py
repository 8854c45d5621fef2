"""What a worker's KV handoffs need inside its engine core process: a thread of
their own with an asyncio loop, and the outputs of the prompts the core runs for itself (the core's
step loop, which HandoffPort drives, answers their calls between steps: StepLoop.call).

A decode worker's core (services/disagg/decode.py CoreDecode) receives KV; a prefill worker's
(services/disagg/prefill.py CorePrefill) computes prompts and sends theirs. Either way the KV moves in the process
that owns the cache, and the serving process keeps the gRPC streams. Each request's handoff runs as a
task in the trace context its add carried (the serving process's span of the call), so the spans it
makes in the core (decode.reserve, decode.prefill_rpc, decode.kv_transfer; prefill.queue,
prefill.compute, prefill.kv_send) join the request's trace, exported by the core itself.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, TypeVar

import torch

from splitserve.common.tracing import remote_task_context
from splitserve.services.disagg.rank_transfers import start_loop_thread
from splitserve.services.engine.engine import Engine
from splitserve.services.engine.output_processor import OutputProcessor
from splitserve.services.engine.outputs import RequestOutput, StepTokens
from splitserve.services.engine.request import Request
from splitserve.services.engine.step_loop import StepLoop
from splitserve.services.engine.streams import RequestFailed, post_to_loop, set_exception, set_result

log = logging.getLogger("splitserve.services.engine")

T = TypeVar("T")
CLOSE_TASKS_TIMEOUT_S = 2.0  # a closing core's wait for its handoffs' tasks to end once cancelled


class CorePrompts:
    """Outputs of the prompts the core runs for itself (a prefill worker's): each step's tokens go
    through an output processor of their own on the step loop (PipeOutputs' tap), and a prompt's
    final output resolves its waiter. Everything here but `run` runs on the step loop."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._processor = OutputProcessor(engine.tokenizer)
        self._waiters: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Future[RequestOutput]]] = {}

    async def run(self, steps: StepLoop, request: Request) -> RequestOutput:
        """From the handoff loop: add a validated request and return its final output (a prompt that
        stops after its prefill has one); a cancel aborts it."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[RequestOutput] = loop.create_future()
        steps.post(self.add, request, loop, future)
        try:
            return await future
        except asyncio.CancelledError:
            steps.post(self.abort, request.request_id)
            raise

    def add(self, request: Request, loop: asyncio.AbstractEventLoop, future: asyncio.Future[RequestOutput]) -> None:
        self._processor.add(request, time.monotonic())
        self._waiters[request.request_id] = (loop, future)
        try:
            self._engine.add_request(request)
        except ValueError as e:  # its id is in use
            self._forget(request.request_id)
            post_to_loop(loop, set_exception, future, e)

    def abort(self, request_id: str) -> None:
        if self._forget(request_id):
            self._engine.abort_request(request_id)

    def on_step(self, step: StepTokens) -> None:
        if not self._waiters:
            return
        for out in self._processor.process(step).outputs:
            if out.finished and (waiter := self._waiters.pop(out.request_id, None)) is not None:
                loop, future = waiter
                if out.error is not None:
                    post_to_loop(loop, set_exception, future, RequestFailed(out.error))
                else:
                    post_to_loop(loop, set_result, future, out)

    def _forget(self, request_id: str) -> bool:
        self._processor.abort(request_id)
        return self._waiters.pop(request_id, None) is not None


class CoreLoop:
    """The handoffs' thread and asyncio loop in the core, one task per request until the serving
    process is told how it went."""

    def __init__(self, name: str, engine: Engine, device: torch.device) -> None:
        """engine: it owns each task's end (an abort cancels it); device: the engine's, the thread is
        bound to it (pinned staging, side streams and NCCL groups are made here: unbound, they would
        make a CUDA context on device 0 too)."""
        self._engine = engine
        self._tasks: dict[str, asyncio.Task] = {}  # on the loop only
        self.loop = start_loop_thread(name, device)

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """From another thread: run coroutine on the loop and wait for it."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    def start_task(
        self,
        request_id: str,
        coroutine_fn: Callable[[], Coroutine[Any, Any, None]],
        trace_context: Mapping[str, str] | None = None,
    ) -> None:
        """From another thread: run coroutine_fn() as request_id's task, its spans children of the
        serving process's span that trace_context carries (and its log lines naming the request).
        The engine owns its end: the request's abort cancels it (Engine.run_outside)."""

        def start() -> None:
            context = remote_task_context(trace_context or {}, request_id)
            task = self.loop.create_task(coroutine_fn(), context=context)
            self._tasks[request_id] = task
            task.add_done_callback(lambda _: self._ended(request_id))

        self._engine.run_outside(request_id, lambda: self.cancel(request_id))
        self.loop.call_soon_threadsafe(start)

    def _ended(self, request_id: str) -> None:
        self._tasks.pop(request_id, None)
        self._engine.done_outside(request_id)

    def cancel(self, request_id: str) -> None:
        """From any thread: cancel request_id's task, if it still runs."""

        def cancel() -> None:
            task = self._tasks.get(request_id)
            if task is not None:
                task.cancel()

        self.loop.call_soon_threadsafe(cancel)

    def close(self, close: Callable[[], Coroutine[Any, Any, None]]) -> None:
        """As asyncio.run ends: cancel every task on the loop (the requests' and what their handoffs
        left behind: a send, a landing) and give them a moment to end, so what they post (their
        blocks' release) is queued before the core aborts the rest; then run close() and stop."""

        async def stop() -> None:
            tasks = asyncio.all_tasks() - {asyncio.current_task()}
            for task in tasks:
                task.cancel()
            if tasks:
                await asyncio.wait(tasks, timeout=CLOSE_TASKS_TIMEOUT_S)
            await close()

        try:
            asyncio.run_coroutine_threadsafe(stop(), self.loop).result(timeout=5.0)
        except Exception:  # the core is exiting either way
            log.exception("closing the core's handoffs failed")
        self.loop.call_soon_threadsafe(self.loop.stop)
