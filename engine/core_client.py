"""The serving process's side of an engine core process (engine/core_process.py): AsyncEngine's
serving calls (generate, abort, died, shutdown) and HandoffPort's reports (load, the KV-event
snapshot, the engine's sizes), over a pipe to the process that steps.

Two threads here, neither waiting on the core:
- the event loop: the streams, and commands written to the pipe (an add is a few hundred bytes),
- the event reader: reads CoreEvents, turns a step's outputs into RequestOutputs and hands them
  to the event loop in one callback per step; keeps the latest load report.

A request refused by the core ends its stream with ValueError (the caller's fault), one the step
failed for with RequestFailed. If the core process dies or its loop does, every stream and pending
query gets EngineDead and `died` is set, as AsyncEngine does for a dead step loop.
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import logging
import multiprocessing
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

from splitserve.common.block_hash import BlockHash
from splitserve.common.kv_events import KVCacheEvent
from splitserve.common.sampling_params import SamplingParams
from splitserve.common.wire import kv_events_from_proto
from splitserve.engine.config import EngineConfig
from splitserve.engine.core_process import run_engine_core
from splitserve.engine.core_wire import load_from_proto, output_from_proto, params_to_proto, running_outputs_from_proto
from splitserve.engine.engine import Engine, RequestOutput
from splitserve.engine.handoff_port import EngineLoad
from splitserve.engine.step_loop import EngineDead
from splitserve.engine.streams import Streams, post_to_loop
from splitserve.protos.v1 import engine_core_pb2 as pb

log = logging.getLogger("splitserve.engine")

SHUTDOWN_TIMEOUT_S = 30.0  # a core that has not exited by then (a step stuck) is killed


class EngineCoreClient:
    def __init__(self, process: BaseProcess, conn: Connection, ready: pb.CoreReady) -> None:
        self._process, self._conn = process, conn
        self.block_size, self.max_model_len, self.vocab_size = ready.block_size, ready.max_model_len, ready.vocab_size
        self.tensor_parallel_size, self.num_kv_heads = ready.tensor_parallel_size, ready.num_kv_heads
        self._load = load_from_proto(ready.load)  # replaced whole by the reader (a racy read is a whole one)
        self._streams = Streams(self.abort)
        self._ids = itertools.count()
        self._call_ids = itertools.count(1)
        self._replies: dict[int, asyncio.Future[pb.CoreReply]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reader: threading.Thread | None = None
        self._death: str | None = None  # the core's last word: why its loop died
        self._shutting_down = False
        self.died = asyncio.Event()  # the core died: this engine serves nothing more

    @classmethod
    def launch(cls, config: EngineConfig, prepare: Callable[[Engine], None] | None = None) -> EngineCoreClient:
        """Spawn the core, and wait while it loads and warms up (blocking: before serving starts).
        prepare(engine) runs in the core after warm-up (a module-level function: it is pickled)."""
        context = multiprocessing.get_context("spawn")  # never fork a process that may hold CUDA state
        conn, child_conn = context.Pipe()
        level = logging.getLogger().getEffectiveLevel()
        process = context.Process(
            target=run_engine_core, args=(config, child_conn, level, prepare), name="splitserve-engine-core"
        )
        process.start()
        child_conn.close()  # ours is the only other end: the core sees EOF when this process is gone
        # A core nobody shut down ends with this process: before multiprocessing's exit handler joins
        # its children (handlers run last registered first), or that join would wait for ever.
        atexit.register(_end_orphan, process)
        return cls(process, conn, _wait_ready(process, conn))

    # -- AsyncEngine's serving calls ------------------------------------------------------------------
    def start(self) -> None:
        """Start reading the core's events (from the event loop that consumes the streams)."""
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            self._reader = threading.Thread(
                target=self._read_events, args=(self._loop,), name="core-events", daemon=True
            )
            self._reader.start()

    async def generate(
        self,
        prompt: Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
        label: str = "",
    ) -> AsyncIterator[RequestOutput]:
        """Token ids in, outputs out (ValueError: refused, here or by the core)."""
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        add = pb.CoreAddRequest(
            request_id=request_id,
            prompt_token_ids=prompt,
            params=params_to_proto(params),
            priority=priority,
            label=label,
        )
        self.start()
        self._streams.open(request_id, label)
        try:
            self._send(pb.CoreCommand(add=add))
        except EngineDead:
            self._streams.close(request_id, finished=True)
            raise
        async for out in self._streams.read(request_id):
            yield out

    def abort(self, request_id: str) -> None:
        if self._streams.error is None:
            try:
                self._send(pb.CoreCommand(abort_request_id=request_id))
            except EngineDead:  # gone with the core
                pass

    def abort_label(self, label: str) -> int:
        """Abort every request carrying the client's id label; returns how many."""
        request_ids = self._streams.labelled(label)
        for request_id in request_ids:
            self.abort(request_id)
        return len(request_ids)

    def num_requests(self) -> int:
        return len(self._streams)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._streams

    async def shutdown(self) -> None:
        """Stop the core after its current step (outputs computed are still delivered) and wait for
        it to exit; killed if it has not within SHUTDOWN_TIMEOUT_S. load() is then its final state."""
        self._shutting_down = True
        try:
            self._send(pb.CoreCommand(shutdown=True))
        except EngineDead:
            pass
        await asyncio.to_thread(self._process.join, SHUTDOWN_TIMEOUT_S)
        if self._process.is_alive():
            log.error("the engine core did not exit within %.0f s of shutdown; killing it", SHUTDOWN_TIMEOUT_S)
            self._process.kill()
            await asyncio.to_thread(self._process.join)
        if self._reader is not None:  # it has read the core's last events (its final load) at EOF
            await asyncio.to_thread(self._reader.join, 5.0)
        self._conn.close()

    @property
    def exitcode(self) -> int | None:
        return self._process.exitcode

    # -- HandoffPort's reports ------------------------------------------------------------------------
    def load(self) -> EngineLoad:
        """The engine's load as of at most 100 ms ago (the core reports it when it changes)."""
        return self._load

    async def kv_snapshot(self) -> tuple[list[BlockHash], list[KVCacheEvent]]:
        """The pool's cached hashes and its pending events, taken together between steps."""
        reply = await self._query(pb.CORE_QUERY_KIND_KV_SNAPSHOT)
        return [BlockHash(h) for h in reply.block_hashes], list(kv_events_from_proto(reply.events))

    async def drain_kv_events(self) -> list[KVCacheEvent]:
        reply = await self._query(pb.CORE_QUERY_KIND_DRAIN_KV_EVENTS)
        return list(kv_events_from_proto(reply.events))

    async def _query(self, kind: pb.CoreQueryKind) -> pb.CoreReply:
        if self._streams.error is not None:
            raise self._streams.error
        self.start()
        call_id = next(self._call_ids)
        future = self._replies[call_id] = asyncio.get_running_loop().create_future()
        try:
            self._send(pb.CoreCommand(query=pb.CoreQuery(call_id=call_id, kind=kind)))
            return await future
        finally:
            self._replies.pop(call_id, None)

    # -- the pipe -------------------------------------------------------------------------------------
    def _send(self, command: pb.CoreCommand) -> None:
        try:
            self._conn.send_bytes(command.SerializeToString())
        except OSError as e:
            raise self._streams.error or EngineDead(f"the engine core is gone ({e}); retry on another worker") from e

    def _read_events(self, loop: asyncio.AbstractEventLoop) -> None:
        while True:
            try:
                event = pb.CoreEvent.FromString(self._conn.recv_bytes())
            except (EOFError, OSError):  # the core exited (or we closed the pipe at shutdown)
                post_to_loop(loop, self._lost)
                return
            kind = event.WhichOneof("event")
            if kind == "outputs":
                self._outputs(loop, event.outputs)
            elif kind == "load":
                self._load = load_from_proto(event.load)
            elif kind == "reply":
                post_to_loop(loop, self._answer, event.reply)
            elif kind == "died":
                self._death = event.died

    def _outputs(self, loop: asyncio.AbstractEventLoop, step: pb.CoreStepOutputs) -> None:
        outputs = running_outputs_from_proto(step)
        for msg in step.outputs:
            if msg.error_kind == pb.CORE_ERROR_KIND_INVALID_ARGUMENT:
                post_to_loop(loop, self._streams.fail, msg.request_id, ValueError(msg.error))
            else:
                outputs.append(output_from_proto(msg))
        if outputs:
            post_to_loop(loop, self._streams.dispatch, outputs)

    def _answer(self, reply: pb.CoreReply) -> None:
        future = self._replies.get(reply.call_id)
        if future is not None and not future.done():
            future.set_result(reply)

    def _lost(self) -> None:
        """On the event loop: the core's end of the pipe closed."""
        self._process.join(timeout=1.0)  # it is exiting: its status says how
        status = self._process.exitcode
        why = self._death or f"the engine core process exited (status {status})"
        error = EngineDead(f"this worker's engine died: {why}; retry the request on another worker")
        self._streams.fail_all(error)
        for future in self._replies.values():
            if not future.done():
                future.set_exception(error)
        if not self._shutting_down:
            log.error("%s", why)
            self.died.set()  # the server reads it, leaves the cluster, exits


def _end_orphan(process: BaseProcess) -> None:
    if process.is_alive():
        process.terminate()


def _wait_ready(process: BaseProcess, conn: Connection) -> pb.CoreReady:
    """The core's CoreReady, or RuntimeError if it exited first (its log says why)."""
    try:
        event = pb.CoreEvent.FromString(conn.recv_bytes())  # EOF if it exits while loading
    except EOFError:
        process.join()
        raise RuntimeError(
            f"the engine core exited with status {process.exitcode} while loading the model; see its log above"
        ) from None
    if event.WhichOneof("event") != "ready":
        process.kill()
        raise RuntimeError(f"the engine core sent {event.WhichOneof('event')} before it was ready")
    return event.ready
