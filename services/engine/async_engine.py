"""asyncio front of the engine: one async generator per request; cancelling it aborts the request.

Three threads, none waiting on another on the hot path:
- the event loop (gRPC, the streams): validates requests in their own task (pure) and queues adds,
  aborts and calls for the step thread; outputs reach it once per step (one call_soon_threadsafe),
- the step thread (bound to the engine's device for its life): applies the queued commands
  between steps, then schedules, runs the forward and samples, step after step, without a round
  trip through the event loop,
- the engine's output thread: detokenization, stop strings and outputs, off the step loop.

A request the step failed for ends its stream with RequestFailed; the loop goes on. If the step
loop itself dies (the engine's state can no longer be trusted), every stream gets the error, new
requests are refused, and `died` is set so the server can leave the cluster and exit.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from splitserve.common.sampling_params import SamplingParams
from splitserve.services.engine.config import EngineConfig
from splitserve.services.engine.cpu_threads import on_passing_thread
from splitserve.services.engine.engine import Engine, PromptInput, RequestOutput
from splitserve.services.engine.request import Request
from splitserve.services.engine.step_loop import EngineDead, StepLoop
from splitserve.services.engine.streams import (
    RequestFailed,
    Streams,
    answer_call,
    post_to_loop,
    set_exception,
    set_result,
)

T = TypeVar("T")
__all__ = ["AsyncEngine", "EngineDead", "RequestFailed"]


class AsyncEngine:
    outputs_here = True  # its output thread processes the steps' tokens in this process (EngineFront)

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        # Adds, aborts and calls for the step thread, applied in order between steps; a call's future
        # is resolved back on the event loop (and failed, with the rest, if the loop dies).
        self._steps = StepLoop(engine)
        self._calls: set[asyncio.Future] = set()
        self._streams = Streams(self.abort)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._step_thread: threading.Thread | None = None
        self._closing = threading.Event()  # the running step thread's: stop after the current step
        self._stopped: asyncio.Future[None] | None = None  # resolved when the step thread has ended
        self._watch: asyncio.Task | None = None  # ends the step thread if the event loop goes away
        self.died = asyncio.Event()  # the step loop raised: this engine serves nothing more

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncEngine:
        """Loaded on a thread that ends: the step thread's OpenMP pool is then the only one (a pool
        on the caller's thread would slow every step: services/engine/cpu_threads.py)."""
        return cls(on_passing_thread(Engine, config))

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
        self._submit(request)
        async for out in self.stream(request.request_id):  # not through generate_request: a layer less per output
            yield out

    def make_request(self, prompt: PromptInput, params: SamplingParams, priority: int = 0, label: str = "") -> Request:
        """A validated request named by the engine (pure: safe from any task)."""
        return self.engine.make_request(prompt, params, priority=priority, label=label)

    async def generate_request(self, request: Request) -> AsyncIterator[RequestOutput]:
        """Add a validated request and stream its outputs."""
        self._submit(request)
        async for out in self.stream(request.request_id):
            yield out

    def _submit(self, request: Request) -> None:
        self.open_stream(request.request_id, request.label)
        self.post(self._add, request)

    def open_stream(self, request_id: str, label: str = "") -> None:
        """Claim request_id and start collecting its step outputs (stream() reads them)."""
        self._streams.open(request_id, label)

    def stream(self, request_id: str) -> AsyncIterator[RequestOutput]:
        """Outputs of an opened request until it finishes; leaving early aborts it."""
        return self._streams.read(request_id)

    def close_stream(self, request_id: str, finished: bool) -> None:
        self._streams.close(request_id, finished)

    async def call(self, fn: Callable[..., T], *args) -> T:
        """Run fn(*args) on the step thread between steps (the only safe time to touch engine state)."""
        if self._streams.error is not None:
            raise self._streams.error
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._calls.add(future)
        future.add_done_callback(self._calls.discard)
        self.post(answer_call, loop, future, fn, args)
        return await future

    def abort(self, request_id: str) -> None:
        if self._step_thread is not None:  # otherwise the engine never saw it
            self.post(self.engine.abort_request, request_id)

    def abort_label(self, label: str) -> int:
        """Abort every request carrying the client's id label; returns how many."""
        return self._streams.abort_label(label)

    def num_requests(self) -> int:
        return len(self._streams)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._streams

    async def shutdown(self) -> None:
        """Stop the step thread after its current step (outputs still queued are delivered)."""
        if self._step_thread is None or self._stopped is None:
            return
        self._closing.set()
        self._steps.wake()
        await self._stopped
        self._step_thread, self._stopped, self._watch = None, None, None

    def close(self) -> None:
        """Free the engine's resources (its tensor-parallel ranks, its output thread), after shutdown."""
        self.engine.close()

    def start(self) -> None:
        """Start the step thread now (from the event loop) rather than at the first request: a server
        does, so that a failure found while idle (a tensor-parallel rank that exited) ends the loop."""
        self._start()

    # -- the event loop's side ----------------------------------------------------------------------
    def post(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run fn(*args) on the step thread between steps, without waiting for it (fn must not raise:
        an error there ends the step loop)."""
        self._steps.post(fn, *args)
        self._start()

    def _start(self) -> None:
        """Start the step thread on first use (or in a new event loop: the last one's is ending), and wake it."""
        loop = asyncio.get_running_loop()
        if self._streams.error is None and (self._step_thread is None or self._loop is not loop):
            self._loop, self._closing = loop, threading.Event()
            self._stopped = loop.create_future()
            self._step_thread = threading.Thread(
                target=self._run_steps, args=(loop, self._closing, self._stopped), name="engine-step", daemon=True
            )
            self._step_thread.start()
            self._watch = loop.create_task(self._stop_with_the_loop(self._stopped, self._closing))
        self._steps.wake()

    async def _stop_with_the_loop(self, stopped: asyncio.Future[None], closing: threading.Event) -> None:
        """Cancelled when its event loop shuts down (asyncio.run cancels what is left): then nobody
        reads the streams any more, so the step thread stops after its current step."""
        try:
            await asyncio.shield(stopped)
        except asyncio.CancelledError:
            closing.set()
            self._steps.wake()
            raise

    def _die(self, error: EngineDead) -> None:
        self._streams.fail_all(error)
        for future in list(self._calls):  # their commands were dropped with the loop
            set_exception(future, error)
        self.died.set()  # the server reads it, leaves the cluster, exits

    # -- the step thread ----------------------------------------------------------------------------
    def _run_steps(self, loop: asyncio.AbstractEventLoop, closing: threading.Event, stopped: asyncio.Future) -> None:
        error = self._steps.run(closing, lambda outputs: post_to_loop(loop, self._streams.dispatch, outputs))
        if error is not None:
            post_to_loop(loop, self._die, error)
        post_to_loop(loop, set_result, stopped, None)

    def _add(self, request: Request) -> None:
        if request.request_id in self._streams:  # not cancelled before it got here
            self.engine.add_request(request)
