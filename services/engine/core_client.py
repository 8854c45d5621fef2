"""The serving process's side of an engine core process (services/engine/core_process.py): the
serving calls (generate, prefill, abort, died, shutdown) and HandoffPort's reports (load, the KV-event
snapshot, the engine's sizes), over a pipe to the process that steps. The same client serves a core
stepping on a thread of this process (EngineCoreClient.in_process: unit tests, no spawn), over a pipe
all the same.

Threads here, none of them waiting on the core:
- the event loop: the streams, and commands queued for the pipe (an add is a few hundred bytes); a
  new request waits, asynchronously, while the commands not yet written fill the queue (admission's
  backpressure: a core that reads slowly never blocks the loop),
- the command writer (services/engine/core_pipe.py): the only writer of the pipe, in the order commands were
  queued,
- the event reader: reads CoreEvents; runs output processing on each step's tokens (incremental
  detokenization, stop strings, logprobs, the RequestOutputs: services/engine/output_processor.py, as vLLM
  v1's frontend process does), queues the step's acknowledgement to the core with the requests a
  stop string ended, and hands the outputs to the event loop in one callback per step; keeps the
  latest load,
- the watchdog: a core that sends nothing (no step, no load: it sends one at least every second
  while its step loop comes round) for stall_timeout_s while work is queued is hung or wedged; it
  is killed, and so ends as a dead core does (below).

So the core's GIL serves the step loop alone. A request refused by the core ends its stream with
ValueError (the caller's fault), one the step failed for with RequestFailed. If the core process
dies or its loop does (or the watchdog gives up on it), every stream and pending query gets
EngineDead and `died` is set; the worker then stops
serving and exits non-zero, to be restarted.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import dataclasses
import itertools
import logging
import math
import multiprocessing
import socket
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

import torch

from splitserve.common.block_hash import BlockHash
from splitserve.common.kv_events import KVCacheEvent
from splitserve.common.sampling_params import SamplingParams
from splitserve.common.tokenizer import Tokenizer
from splitserve.common.tracing import Span, trace_carrier, tracer
from splitserve.common.wire import kv_events_from_proto, params_to_proto
from splitserve.protos.v1 import engine_core_pb2 as pb
from splitserve.protos.v1 import worker_pb2 as wpb
from splitserve.services.engine.config import EngineConfig
from splitserve.services.engine.core_pipe import PipeWriter
from splitserve.services.engine.core_process import CoreTraces, EngineCore, HandoffsSetup, run_engine_core
from splitserve.services.engine.core_wire import (
    finishes_from_proto,
    handoff_times_from_proto,
    load_from_proto,
    logprobs_from_step_proto,
)
from splitserve.services.engine.engine import Engine, RequestOutput
from splitserve.services.engine.handoff_port import EngineLoad
from splitserve.services.engine.output_processor import OutputProcessor, OutputRequest, yield_gil
from splitserve.services.engine.outputs import StepTokens
from splitserve.services.engine.request import HandoffTimes, RequestStatus
from splitserve.services.engine.step_loop import EngineDead
from splitserve.services.engine.streams import Streams, post_to_loop
from splitserve.services.model.loader import open_model

log = logging.getLogger("splitserve.services.engine")

SHUTDOWN_TIMEOUT_S = 30.0  # a core that has not exited by then (a step stuck) is killed
# A core silent this long while work is queued makes no progress: far above its longest step and its
# keepalive (a second), so only a hung or wedged core reaches it.
STALL_TIMEOUT_S = 60.0


class EngineCoreClient:
    def __init__(
        self,
        process: BaseProcess | CoreThread,
        conn: Connection,
        ready: pb.CoreReady,
        tokenizer: Tokenizer,
        stall_timeout_s: float | None = STALL_TIMEOUT_S,
    ) -> None:
        """process: the core's process, or its thread (in_process); stall_timeout_s: the watchdog's
        bound (None: no watchdog)."""
        self._process, self._conn = process, conn
        # The event loop (commands) and the reader (acknowledgements) queue; one thread writes.
        self._commands = PipeWriter(conn, "core-commands", _pipe_lost)
        self._room = asyncio.Event()  # set (on the loop) when a full command queue gets room
        self._stall_timeout_s = stall_timeout_s
        self._last_event_at = time.monotonic()  # the reader's: when the core last sent anything
        self._stalled: str | None = None  # the watchdog's: why it gave up on the core
        self._unwatched = threading.Event()  # set at shutdown: the watchdog stops
        # Output processing, on the reader thread; the event loop adds and aborts requests: one lock.
        self._processor = OutputProcessor(tokenizer)
        self._processing = threading.Lock()
        self._reaping = threading.Lock()  # _reap
        self._records: dict[str, _Record] = {}
        self.block_size, self.max_model_len, self.vocab_size = ready.block_size, ready.max_model_len, ready.vocab_size
        self.tensor_parallel_size, self.num_kv_heads = ready.tensor_parallel_size, ready.num_kv_heads
        self.num_threads = ready.num_threads  # torch's CPU threads in the core
        self._load = load_from_proto(ready.load)  # replaced whole by the reader (a racy read is a whole one)
        # A prefill worker's calls run in the core: each one's events or its error
        self._prefills: dict[str, asyncio.Queue[pb.CorePrefillEvent | BaseException]] = {}
        self._prefill_labels: dict[str, str] = {}  # a Prefill call's request id -> the client's id (Abort by it)
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
    def launch(
        cls,
        config: EngineConfig,
        prepare: Callable[[Engine], None] | None = None,
        handoffs: HandoffsSetup | None = None,
        traces: CoreTraces | None = None,
        stall_timeout_s: float = STALL_TIMEOUT_S,
    ) -> EngineCoreClient:
        """Spawn the core, and wait while it loads and warms up (blocking: before serving starts).
        prepare(engine) runs in the core after warm-up (a module-level function: it is pickled);
        handoffs makes a prefill or decode worker's KV handoffs there (services/disagg/prefill.py, decode.py);
        traces: where the core exports its spans (its handoffs'), as the worker does; stall_timeout_s:
        the watchdog's bound on a core's silence while work is queued."""
        context = multiprocessing.get_context("spawn")  # never fork a process that may hold CUDA state
        conn, child_conn = context.Pipe()
        level = logging.getLogger().getEffectiveLevel()
        process = context.Process(
            target=run_engine_core,
            args=(config, child_conn, level, prepare, handoffs, traces, torch.get_num_threads()),
            name="splitserve-engine-core",
        )
        process.start()
        child_conn.close()  # ours is the only other end: the core sees EOF when this process is gone
        # A core nobody shut down ends with this process: before multiprocessing's exit handler joins
        # its children (handlers run last registered first), or that join would wait for ever.
        atexit.register(_end_orphan, process)
        tokenizer = open_model(config.model).tokenizer  # while the core loads
        return cls(process, conn, _wait_ready(process, conn), tokenizer, stall_timeout_s)

    @classmethod
    def in_process(cls, engine: Engine, handoffs: HandoffsSetup | None = None) -> EngineCoreClient:
        """The same core and client, the core stepping on a thread of this process (over a pipe all
        the same): the engine core for unit tests and the offline engine, with no spawn and the engine
        shared with the caller. No watchdog (a thread cannot be killed); the core closes the engine's
        output sink when it stops, so the engine serves a later client, or steps on its own."""
        conn, core_conn = multiprocessing.Pipe()
        core = CoreThread(EngineCore(engine, core_conn, handoffs))
        core.start()
        return cls(core, conn, _wait_ready(core, conn), engine.tokenizer, stall_timeout_s=None)

    # -- serving calls ---------------------------------------------------------------------------------
    def start(self) -> None:
        """Start reading the core's events, and watching it (from the event loop that consumes the streams)."""
        if self._loop is None:
            loop = self._loop = asyncio.get_running_loop()
            self._commands.on_room = lambda: post_to_loop(loop, self._room.set)
            self._reader = threading.Thread(target=self._read_events, args=(loop,), name="core-events", daemon=True)
            self._reader.start()
            if self._stall_timeout_s is not None:
                threading.Thread(target=self._watch, args=(loop,), name="core-watchdog", daemon=True).start()

    async def generate(
        self,
        prompt: Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
        label: str = "",
    ) -> AsyncIterator[RequestOutput]:
        """Token ids in, outputs out (ValueError: refused, here or by the core)."""
        call = wpb.WorkerGenerateRequest(
            request_id=label, prompt_token_ids=prompt, params=params_to_proto(params), priority=priority
        )
        async with contextlib.aclosing(self.generate_call(call, params, request_id)) as outputs:
            async for out in outputs:  # closed with this one: an early leave aborts at once
                yield out

    async def generate_call(
        self, call: wpb.WorkerGenerateRequest, params: SamplingParams, request_id: str | None = None
    ) -> AsyncGenerator[RequestOutput, None]:
        """A Generate call, forwarded to the core as it was received (params: its parameters, read
        here for output processing). With a prefill_address (a decode worker's), the core gets the
        prompt's KV from that prefill worker (CoreRefused: the handoff could not start)."""
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        handoff = bool(call.prefill_address)
        # trace_context: the parent of the spans its handoff makes in the core
        add = pb.CoreAddRequest(request_id=request_id, generate=call, trace_context=trace_carrier())
        self.start()
        await self._admit()
        self._streams.open(request_id, call.request_id)
        so_far = call.continuation  # a migrated stream's: what its client already has
        tokens = [*call.prompt_token_ids, *so_far.output_token_ids]
        record = _Record(request_id, params, tokens, len(call.prompt_token_ids))
        self._track(record, so_far.num_text_chars)
        self._send(pb.CoreCommand(add=add))
        decoding: Span | None = None  # a handed-off request's decode.decode span, from its landing to its end
        outputs = self._streams.read(request_id)
        try:
            async for out in outputs:
                if handoff:
                    if decoding is None and out.num_output_tokens > 1:  # decoded in the batch, so it landed
                        decoding = tracer.start_span("decode.decode", start_time=_landed_ns(record))
                    if out.finished and decoding is not None:
                        decoding.set_attribute("splitserve.num_output_tokens", out.num_output_tokens)
                yield out
        finally:
            await outputs.aclose()  # a caller that leaves early aborts the request now, not when collected
            if decoding is not None:
                decoding.end()

    async def prefill(self, call: wpb.PrefillRequest) -> AsyncIterator[pb.CorePrefillEvent]:
        """A prefill worker's Prefill call, forwarded to the core as it was received and run there
        (services/disagg/prefill.py CorePrefill): its events, each with its response as the call
        streams it (already encoded, by the core), through its TransferDone. ValueError: refused
        for its input; CoreRefused: failed (the status code's name says how); leaving early aborts it."""
        request_id = f"req-{next(self._ids)}"
        # trace_context: the parent of the spans the core makes for the call
        add = pb.CoreAddRequest(request_id=request_id, prefill=call, trace_context=trace_carrier())
        self.start()
        await self._admit()
        if self._streams.error is not None:
            raise self._streams.error
        events = self._prefills[request_id] = asyncio.Queue()
        self._prefill_labels[request_id] = call.request.request_id
        finished = False
        try:
            self._send(pb.CoreCommand(add=add))
            while not finished:
                event = await events.get()
                if isinstance(event, BaseException):
                    finished = True
                    raise event
                finished = event.kind == pb.CORE_PREFILL_EVENT_KIND_TRANSFER_DONE
                yield event
        finally:
            self._prefills.pop(request_id, None)
            self._prefill_labels.pop(request_id, None)
            if not finished and self._streams.error is None:
                self._send(pb.CoreCommand(abort_request_id=request_id))

    def _prefilled(self, event: pb.CorePrefillEvent) -> None:
        events = self._prefills.get(event.request_id)
        if events is not None:
            events.put_nowait(event)

    def abort(self, request_id: str) -> None:
        final = self._untrack(request_id)  # tokens the core computed meanwhile are dropped
        if final is not None:  # a stream still read (an abort by the client's id) ends with it
            self._streams.dispatch([final])
        if self._streams.error is None:  # else gone with the core
            self._send(pb.CoreCommand(abort_request_id=request_id))

    def abort_label(self, label: str) -> int:
        """Abort every request carrying the client's id label, Prefill calls too (each ends with
        CoreRefused CANCELLED, and the core aborts it: its prompt or its send); returns how many."""
        prefills = [rid for rid, lab in self._prefill_labels.items() if lab == label]
        for request_id in prefills:
            aborted = CoreRefused("CANCELLED", f"the Prefill call for {label!r} was aborted by its id (Worker.Abort)")
            self._prefills[request_id].put_nowait(aborted)  # a refusal: the call's end tells the core nothing
            if self._streams.error is None:
                self._send(pb.CoreCommand(abort_request_id=request_id))
        return self._streams.abort_label(label) + len(prefills)

    def num_requests(self) -> int:
        return len(self._streams) + len(self._prefills)

    async def shutdown(self) -> None:
        """Stop the core after its current step (outputs computed are still delivered) and wait for
        it to exit; killed if it has not within SHUTDOWN_TIMEOUT_S. load() is then its final state."""
        self._shutting_down = True
        self._unwatched.set()
        self._send(pb.CoreCommand(shutdown=True))
        await asyncio.to_thread(self._reap, SHUTDOWN_TIMEOUT_S)
        if self._process.is_alive():
            log.error("the engine core did not exit within %.0f s of shutdown; killing it", SHUTDOWN_TIMEOUT_S)
            self._process.kill()
            await asyncio.to_thread(self._reap, None)
        if self._reader is not None:  # it has read the core's last events (its final load) at EOF
            await asyncio.to_thread(self._reader.join, 5.0)
        await asyncio.to_thread(self._commands.close, 5.0)  # its pipe is closed next
        self._conn.close()

    @property
    def exitcode(self) -> int | None:
        return self._process.exitcode

    def _reap(self, timeout: float | None) -> None:
        """Join the core, one thread at a time: multiprocessing's join is not thread-safe. Of two
        threads joining at once, one reaps the core and the other's waitpid fails, so that thread reads
        no status, and may go on before the first has stored it (CI read a killed core's exitcode as
        None). The reader at EOF, the watchdog and shutdown all join."""
        with self._reaping:
            self._process.join(timeout)

    @property
    def pid(self) -> int | None:
        """The core process's."""
        return self._process.pid

    # -- HandoffPort's reports ------------------------------------------------------------------------
    def load(self) -> EngineLoad:
        """The engine's load: its counts as of the last step whose outputs were read (or the last abort), its
        step totals as of at most 100 ms ago (the core's load clock)."""
        return self._load

    async def kv_snapshot(self) -> tuple[list[BlockHash], list[KVCacheEvent]]:
        """The pool's cached hashes and its pending events, taken together between steps."""
        reply = await self._query(pb.CORE_QUERY_KIND_KV_SNAPSHOT)
        return [BlockHash(h) for h in reply.block_hashes], list(kv_events_from_proto(reply.events))

    async def drain_kv_events(self) -> list[KVCacheEvent]:
        reply = await self._query(pb.CORE_QUERY_KIND_DRAIN_KV_EVENTS)
        return list(kv_events_from_proto(reply.events))

    async def metrics_exposition(self) -> bytes:
        """What the core counts itself (its KV handoffs' metrics), in Prometheus' text format."""
        return (await self._query(pb.CORE_QUERY_KIND_METRICS)).metrics

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

    # -- output processing ----------------------------------------------------------------------------
    def _track(self, record: _Record, num_text_chars_sent: int = 0) -> None:
        self._records[record.request_id] = record
        with self._processing:
            self._processor.add(record, time.monotonic(), num_text_chars_sent)

    def _untrack(self, request_id: str) -> RequestOutput | None:
        """Stop processing a request's tokens; its final output, if it had none yet."""
        if self._records.pop(request_id, None) is None:
            return None
        with self._processing:
            return self._processor.abort(request_id)

    def _process_step(self, loop: asyncio.AbstractEventLoop, msg: pb.CoreStepTokens) -> None:
        """On the reader: a step's outputs to their streams, and the step acknowledged to the core."""
        step = StepTokens(
            requests=self._requests(msg),
            token_ids=list(msg.token_ids),
            finished=finishes_from_proto(msg),
            time=msg.time,
            logprobs=logprobs_from_step_proto(msg),
            failed=[(self._records.get(f.request_id) or _gone(f.request_id), f.message) for f in msg.failed],
        )
        with self._processing:
            done = self._processor.process(step, yield_gil)
        processed = pb.CoreProcessed(ticket=msg.ticket)
        for request_id, status in done.to_finish:
            ids = (
                processed.stopped_request_ids
                if status is RequestStatus.FINISHED_STOPPED
                else processed.failed_request_ids
            )
            ids.append(request_id)
        self._send(pb.CoreCommand(processed=processed))  # queued: the reader never waits to write
        for out in done.outputs:
            if out.finished:
                self._records.pop(out.request_id, None)
        if done.outputs:
            post_to_loop(loop, self._streams.dispatch, done.outputs)

    def _requests(self, msg: pb.CoreStepTokens) -> list[OutputRequest]:
        """The step's requests (each record learns when it was scheduled, once)."""
        records: dict[str, _Record] = self._records
        requests: list[OutputRequest] = []
        for request_id, num_cached, scheduled in zip(msg.request_ids, msg.num_cached_tokens, msg.first_scheduled_times):
            record = records.get(request_id)
            if record is None:  # aborted here: the processor drops its token
                requests.append(_gone(request_id))
                continue
            if record.first_scheduled_time is None and not math.isnan(scheduled):  # NaN: a handoff's first token
                record.num_cached_tokens, record.first_scheduled_time = num_cached, scheduled
            requests.append(record)
        for times in msg.handoff_times:  # set before the step's outputs are made (its stages read them)
            if (record := records.get(times.request_id)) is not None:
                record.handoff_times = handoff_times_from_proto(times)
        return requests

    def _refused(self, refusal: pb.CoreRefusal) -> None:
        self._untrack(refusal.request_id)
        error = (
            CoreRefused(refusal.code, refusal.error, refusal.failed_peer) if refusal.code else ValueError(refusal.error)
        )
        self._streams.fail(refusal.request_id, error)
        if (prefill := self._prefills.get(refusal.request_id)) is not None:
            prefill.put_nowait(error)

    # -- the pipe -------------------------------------------------------------------------------------
    def _send(self, command: pb.CoreCommand) -> None:
        """Queue a command for the core (never waits; dropped once the core is gone: the reader's end
        of the pipe closes then, and every stream ends with EngineDead)."""
        self._commands.put(command.SerializeToString())

    async def _admit(self) -> None:
        """Admission's backpressure: wait while the commands not yet written fill the queue (a core
        that reads slowly, or not at all: then the watchdog ends it)."""
        while not self._commands.has_room() and self._streams.error is None:
            self._room.clear()  # the writer's on_room sets it on the loop, after this
            await self._room.wait()

    def _read_events(self, loop: asyncio.AbstractEventLoop) -> None:
        while True:
            try:
                event = pb.CoreEvent.FromString(self._conn.recv_bytes())
            except (EOFError, OSError):  # the core exited (or we closed the pipe at shutdown)
                self._reap(1.0)  # it is exiting: its status says how (not on the loop)
                post_to_loop(loop, self._lost)
                return
            self._last_event_at = time.monotonic()
            kind = event.WhichOneof("event")
            if kind == "step_tokens":
                if event.step_tokens.HasField("load"):  # before the outputs: their reader sees it
                    counts = load_from_proto(event.step_tokens.load)
                    self._load = dataclasses.replace(counts, steps=self._load.steps)
                self._process_step(loop, event.step_tokens)
            elif kind == "refused":
                post_to_loop(loop, self._refused, event.refused)
            elif kind == "load":
                self._load = load_from_proto(event.load)
            elif kind == "reply":
                post_to_loop(loop, self._answer, event.reply)
            elif kind == "died":
                self._death = event.died
            elif kind == "prefill_event":
                post_to_loop(loop, self._prefilled, event.prefill_event)

    def _answer(self, reply: pb.CoreReply) -> None:
        future = self._replies.get(reply.call_id)
        if future is not None and not future.done():
            future.set_result(reply)

    # -- the watchdog ---------------------------------------------------------------------------------
    def _watch(self, loop: asyncio.AbstractEventLoop) -> None:
        """On its thread: give up on a core silent for stall_timeout_s while work is queued."""
        assert self._stall_timeout_s is not None
        poll_s = self._stall_timeout_s / 8
        while not self._unwatched.wait(poll_s) and self._streams.error is None:
            silent_s = time.monotonic() - self._last_event_at
            if silent_s >= self._stall_timeout_s and self._has_work():
                self._give_up(loop, silent_s)
                return

    def _has_work(self) -> bool:
        """Requests streaming, queries unanswered or commands unwritten (racy reads of sizes: a poll)."""
        return bool(self.num_requests() or self._replies or self._commands.backlog())

    def _give_up(self, loop: asyncio.AbstractEventLoop, silent_s: float) -> None:
        """Kill the core: every stream ends with EngineDead and `died` is set, so the worker leaves
        the cluster (health NOT_SERVING) and exits non-zero, to be restarted."""
        self._stalled = (
            f"the engine core made no progress for {silent_s:.0f} s with {self.num_requests()} requests "
            f"and {self._commands.backlog()} commands queued (hung, or its pipe wedged); it was killed"
        )
        log.error("%s", self._stalled)
        self._process.kill()
        self._reap(5.0)
        post_to_loop(loop, self._lost)  # also when the reader is what is stuck (it would see no EOF)

    def _lost(self) -> None:
        """On the event loop: the core's end of the pipe closed (or the watchdog gave up on it)."""
        if self._streams.error is not None:  # told already (by the watchdog, then by the reader's EOF)
            return
        status = self._process.exitcode
        why = self._stalled or self._death or f"the engine core process exited (status {status})"
        error = EngineDead(f"this worker's engine died: {why}; retry the request on another worker")
        self._streams.fail_all(error)
        self._room.set()  # admissions waiting for room go on, and find the engine dead
        for prefill in self._prefills.values():
            prefill.put_nowait(error)
        for future in self._replies.values():
            if not future.done():
                future.set_exception(error)
        if not self._shutting_down:
            log.error("%s", why)
            self.died.set()  # the server reads it, leaves the cluster, exits


class CoreRefused(Exception):
    """The core ended a request before its first token for a reason other than its input (a decode
    worker's handoff: no room for its KV, or its prefill worker failed): the gRPC status code's name
    for the client, and the worker to blame, if any."""

    def __init__(self, code: str, message: str, failed_peer: str = "") -> None:
        super().__init__(message)
        self.code, self.message, self.failed_peer = code, message, failed_peer


@dataclass(slots=True)
class _Record:
    """What output processing reads of a request this process sent (OutputRequest)."""

    request_id: str
    sampling_params: SamplingParams
    all_token_ids: list[int]  # the prompt, then a migrated stream's tokens so far
    num_prompt_tokens: int
    num_cached_tokens: int = 0  # set from its first step
    first_scheduled_time: float | None = None
    handoff_times: HandoffTimes | None = None  # a decode worker's handed-off request's, from its step tokens


def _landed_ns(record: _Record) -> int | None:
    """When a handed-off request's KV landed, on the wall clock spans use (None: not known)."""
    times = record.handoff_times
    if times is None or times.landed_time is None:
        return None
    return time.time_ns() - int((time.monotonic() - times.landed_time) * 1e9)


def _gone(request_id: str) -> _Record:
    """A stand-in for a request no longer tracked here (its token is dropped)."""
    return _Record(request_id, SamplingParams(), [], 0)


def _pipe_lost(error: OSError) -> None:
    """On the command writer: the core's end closed. The reader sees the end of the pipe too, and
    ends every stream with the core's status."""
    log.debug("the engine core's pipe closed while writing a command (%s)", error)


class CoreThread:
    """An engine core serving on a thread of this process (EngineCoreClient.in_process), with what
    the client reads of a core process."""

    pid = None  # no process of its own

    def __init__(self, core: EngineCore) -> None:
        self.exitcode: int | None = None
        self._thread = threading.Thread(target=self._serve, args=(core,), name="engine-core", daemon=True)

    def _serve(self, core: EngineCore) -> None:
        try:
            self.exitcode = core.serve()
        finally:
            _hang_up(core.conn)

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def kill(self) -> None:
        """A thread cannot be killed: a core that ignored its shutdown is left to end with the process."""


def _hang_up(conn: Connection) -> None:
    """End both directions of a core thread's end of the pipe, as a process's exit would: the client's
    reader sees EOF, and so does the core's own command reader if it still waits (closing the fd alone
    would not wake it, and the socket would stay open under it)."""
    with socket.fromfd(conn.fileno(), socket.AF_UNIX, socket.SOCK_STREAM) as end:  # a duplicate of it
        end.shutdown(socket.SHUT_RDWR)
    conn.close()


def _end_orphan(process: BaseProcess) -> None:
    if process.is_alive():
        process.terminate()


def _wait_ready(process: BaseProcess | CoreThread, conn: Connection) -> pb.CoreReady:
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
