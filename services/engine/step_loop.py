"""The engine's step loop: commands applied between steps, and steps back to back, on one thread.

The engine core's (services/engine/core_process.py: in its process, or on a thread of the caller's for
EngineCoreClient.in_process). Each step's tokens leave through the output sink the core gives (its
pipe to the serving process).

Commands come from any thread and must not raise (`call`, for a caller on an event loop that wants
an answer, catches in the command and forwards the error). If a step raises, the loop ends: the
engine's state can no longer be trusted, so the commands still queued are dropped and the core's
client fails its streams and callers.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from splitserve.services.engine.config import EngineConfig
from splitserve.services.engine.cpu_threads import on_passing_thread
from splitserve.services.engine.engine import Engine
from splitserve.services.engine.model_runner import bind_thread
from splitserve.services.engine.streams import answer_call

if TYPE_CHECKING:
    from splitserve.services.engine.core_process import PipeOutputs

log = logging.getLogger("splitserve.services.engine")

T = TypeVar("T")


class EngineDead(RuntimeError):
    """The engine loop died: this engine runs nothing more (retry elsewhere)."""


def load_engine(config: EngineConfig) -> Engine:
    """The engine, loaded and warmed up for a step loop: every kernel variant a step can hit is
    compiled before serving starts (until then nothing is routed here and health is never SERVING,
    so no request waits on a compile). On a thread that ends, so that the step loop's OpenMP pool is
    the process's only one (services/engine/cpu_threads.py)."""
    return on_passing_thread(_load_and_warm_up, config)


def _load_and_warm_up(config: EngineConfig) -> Engine:
    engine = Engine(config)
    report = engine.warm_up()
    log.info("warm-up before serving: %d steps in %.2f s", report.num_steps, report.seconds)
    return engine


class StepLoop:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        engine.runner.on_ranks_lost(self.fail)  # a tensor-parallel rank exited: the loop dies
        # (fn, args): deque appends and pops are atomic, so any thread may post
        self._commands: deque[tuple[Callable, tuple]] = deque()
        self._wakeup = threading.Event()  # new commands for an idle loop

    def post(self, fn: Callable[..., Any], *args: Any) -> None:
        """From any thread: run fn(*args) between steps (fn must not raise: an error ends the loop)."""
        self._commands.append((fn, args))
        self._wakeup.set()

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """From an event loop: fn(*args) on the step loop, between steps; its result (or error) is
        answered on the caller's loop."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self.post(answer_call, loop, future, fn, args)
        return await future

    def wake(self) -> None:
        self._wakeup.set()

    def fail(self, error: BaseException) -> None:
        """From any thread: the loop raises error at its next turn (it dies); wakes it if idle."""
        self.post(_raise, error)

    def run(self, closing: threading.Event, outputs: PipeOutputs) -> EngineDead | None:
        """Step until closing is set, on this thread (bound to the engine's device: Triton launches on
        the calling thread's current CUDA device). Returns the error if the loop died. outputs: where
        the step tokens go (a core's pipe)."""
        bind_thread(self.engine.runner.device)
        with self.engine.loop_lock:  # a loop of an earlier front may still be ending
            error = self._step_until_closed(closing, outputs)
            if error is not None:
                self._commands.clear()
            return error

    def _step_until_closed(self, closing: threading.Event, outputs: PipeOutputs) -> EngineDead | None:
        engine, error = self.engine, None
        engine.start_output_sink(outputs)
        try:
            while not closing.is_set():
                self.apply_commands()
                engine.expire_leases()
                engine.reserve_queued()  # what the commands or the last step freed
                if engine.has_work():
                    engine.step()
                else:
                    self._idle(closing)
        except Exception as e:  # surface to every waiting stream instead of hanging them
            log.exception("the engine loop died")
            error = EngineDead(
                f"this worker's engine loop died ({type(e).__name__}: {e}); retry the request on another worker"
            )
        engine.stop_output_sink()  # what was stepped still reaches its streams, before any error
        return error

    def _idle(self, closing: threading.Event) -> None:
        """Wait for new commands, waking for the next held-block lease to expire."""
        self._wakeup.clear()
        if self._commands or closing.is_set():
            return
        deadline = self.engine.leases.next_deadline()
        self._wakeup.wait(None if deadline is None else max(0.0, deadline - time.monotonic()) + 0.01)

    def apply_commands(self) -> None:
        """Run the commands posted so far (the loop does between steps; a stopped core, once more)."""
        while self._commands:
            fn, args = self._commands.popleft()
            fn(*args)


def _raise(error: BaseException) -> None:
    raise error
