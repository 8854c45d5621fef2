"""The engine core in a process of its own, fed over a pipe (what vLLM v1 calls the EngineCore).

In one process the step loop shares the GIL with the serving thread: gRPC and one task per stream
wake up for every step's outputs, and at 256 streams that work delays the next step by several
milliseconds (docs/benchmarks.md, "engine core process"). Here the core process steps, and the
serving process (services/engine/core_client.py) does the per-stream work on its own GIL.

Threads of the core process:
- the command reader: reads CoreCommands from the pipe (the blocking read releases the GIL),
  validates new requests (pure) and queues them for the step loop; it never waits to write (a
  refusal is queued), so commands are always read, however slowly the serving process reads events,
- the event writer (services/engine/core_pipe.py): the only writer of the pipe, in the order events were
  queued; the step loop waits for room in its queue before each step's tokens (a serving process
  that falls behind slows the steps), nothing else ever waits for it,
- the step loop (StepLoop.run, the main thread): applies commands between steps, steps,
- no output thread: each step's sampled tokens go onto the pipe as they are known (one CoreEvent
  per step); the serving process detokenizes, finds stop strings and builds the outputs, and acks
  each step with the requests a stop string ended,
- the load clock: every 100 ms asks the step loop for the engine's load, sent when it changed
  (its step totals too) and at least every KEEPALIVE_S: the serving process's watchdog reads the
  silence of a core with work as a core that makes no progress; each step's tokens carry the counts
  when they changed, and an abort is followed by a report, so a load read once a stream has ended
  is already the state after it.

Lifecycle: spawned -> load and warm up -> CoreReady -> commands and events -> a shutdown command,
or the pipe closing (the serving process is gone) -> the loop stops after its step, the outputs
computed are sent, the handoffs closed (5 s at most), the queued events written (FLUSH_TIMEOUT_S at
most) -> exit 0 at once, whatever its threads still wait for. A step loop that dies sends `died` and
exits 1.

A decode or prefill worker's core also runs its KV handoffs (the `handoffs` the spawn is given):
a Generate call with a prefill_address (services/disagg/decode.py CoreDecode: receive the prompt's KV)
or a Prefill call (services/disagg/prefill.py CorePrefill: compute the prompt, send its KV) goes to them
instead of the queue, and a handoff that cannot start or fails refuses its request with a status
code and the worker to blame.

Every message is protobuf (protos/v1/engine_core.proto). The only pickles are what the spawn hands
over at start, from the parent that made them: the EngineConfig, and the handoffs' setup.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Protocol

import torch
from prometheus_client import CollectorRegistry, generate_latest

from splitserve.common.tracing import LOG_FORMAT, setup_tracing
from splitserve.common.wire import kv_events_to_proto, params_from_proto
from splitserve.protos.v1 import engine_core_pb2 as pb
from splitserve.services.engine.config import EngineConfig
from splitserve.services.engine.core_pipe import PipeWriter
from splitserve.services.engine.core_wire import load_to_proto, step_tokens_to_proto
from splitserve.services.engine.engine import Engine
from splitserve.services.engine.handoff_port import engine_load
from splitserve.services.engine.outputs import StepTokens
from splitserve.services.engine.request import Request, RequestStatus
from splitserve.services.engine.step_loop import StepLoop, load_engine

log = logging.getLogger("splitserve.services.engine")

LOAD_INTERVAL_S = 0.1
KEEPALIVE_S = 1.0  # the load goes out at least this often, changed or not, while the step loop comes round
FLUSH_TIMEOUT_S = 5.0  # at exit, for a serving process that reads no more

# How the core's parts send events to the serving process (thread-safe; never waits for the pipe)
Send = Callable[[pb.CoreEvent], None]


class CoreHandoffs(Protocol):
    """Requests whose KV moves between workers: a decode worker's, whose prompt's KV comes from a
    prefill worker (services/disagg/decode.py CoreDecode), or a prefill worker's Prefill calls, whose KV goes to
    a decode worker (services/disagg/prefill.py CorePrefill)."""

    def start(self, request: Request, add: pb.CoreAddRequest) -> None:
        """From the command reader: a decode worker's Generate call with a prefill_address, or a
        prefill worker's Prefill call (the wrong kind for this worker is refused)."""

    def on_step(self, step: StepTokens) -> None:
        """On the step loop, before the step's tokens leave: the outputs the core makes itself."""

    def close(self) -> None:
        """The core is stopping."""


# What the spawn is given to make the core's handoffs once the engine is up (pickled: a dataclass);
# they count their metrics into the core's registry, which the serving process's scrapes read
HandoffsSetup = Callable[[Engine, StepLoop, Send, CollectorRegistry], CoreHandoffs]


def refusal(request_id: str, message: str, code: str = "", failed_peer: str = "") -> pb.CoreEvent:
    """A request ended before it streamed: code "" for its own input (ValueError in the serving
    process), else a gRPC status code's name and the worker to blame, if any (CoreRefused there)."""
    return pb.CoreEvent(
        refused=pb.CoreRefusal(request_id=request_id, error=message, code=code, failed_peer=failed_peer)
    )


@dataclass(frozen=True)
class CoreTraces:
    """Where the core exports its spans (common/tracing.py setup_tracing): the worker's service name
    and --otlp-traces-endpoint (the OTEL_* variables reach the core with the rest of the environment)."""

    service_name: str
    endpoint_flag: str | None = None


def run_engine_core(
    config: EngineConfig,
    conn: Connection,
    log_level: int = logging.INFO,
    prepare: Callable[[Engine], None] | None = None,
    handoffs: HandoffsSetup | None = None,
    traces: CoreTraces | None = None,
    num_threads: int | None = None,
) -> None:
    """The core process's main (a multiprocessing spawn target). prepare(engine) runs after warm-up,
    before serving: benchmarks swap the forward for a stub there. num_threads: torch's CPU threads,
    the serving process's (--num-threads; a spawned interpreter would take every core's otherwise)."""
    if num_threads:
        torch.set_num_threads(num_threads)
    logging.basicConfig(level=log_level, format=LOG_FORMAT.replace("%(name)s", "%(name)s [core]"))
    traces = traces or CoreTraces("engine-core")
    tracing = setup_tracing(traces.service_name, traces.endpoint_flag, log_level)  # and the log lines' context
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the serving process, which shuts us down
    engine = load_engine(config)
    if prepare is not None:
        prepare(engine)
    core = EngineCore(engine, conn, handoffs)
    status = core.serve()
    tracing.shutdown()  # sends the spans still buffered
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    # Not sys.exit: the interpreter's exit joins every executor thread, and a transfer thread blocked
    # on a dead peer (a gloo connect) would keep an orphaned core alive until its timeout.
    os._exit(status)


class EngineCore:
    def __init__(self, engine: Engine, conn: Connection, handoffs: HandoffsSetup | None = None) -> None:
        self.engine, self.conn = engine, conn
        self.steps = StepLoop(engine)
        self.closing = threading.Event()
        self._events = PipeWriter(conn, "core-events", self._pipe_lost)  # the step loop, the reader, handoffs
        self.metrics = CollectorRegistry()  # what is counted here (its handoffs'), read by CORE_QUERY_KIND_METRICS
        self.handoffs = handoffs(engine, self.steps, self._send, self.metrics) if handoffs is not None else None
        self._last_load: pb.CoreLoad | None = None
        self._last_load_at = 0.0  # when the load last went out (the keepalive's clock)
        self._last_counts: pb.CoreLoad | None = None  # the load without its step totals, as last sent
        tap = self.handoffs.on_step if self.handoffs is not None else None
        room = self._events.wait_for_room
        self.outputs = PipeOutputs(self._send, engine.finish_for_outputs, self._changed_counts, tap, room)

    def serve(self) -> int:
        """Serve until shut down or orphaned; the exit status."""
        self._send(pb.CoreEvent(ready=self._ready()))
        threading.Thread(target=self._read_commands, name="core-commands", daemon=True).start()
        threading.Thread(target=self._load_clock, name="core-load", daemon=True).start()
        error = self.steps.run(self.closing, self.outputs)
        if self.handoffs is not None:
            self.handoffs.close()  # a send it ends posts the release of its blocks
        if error is None:
            self.steps.apply_commands()
            self._abort_the_rest()
        self._last_load = None
        self._report_load()  # the state it ends in (a drained worker logs its pool)
        self.engine.close()
        if error is not None:
            self._send(pb.CoreEvent(died=str(error)))
        if not self._events.close(FLUSH_TIMEOUT_S):
            log.warning("the serving process read none of the core's last events; exiting without them")
        return 0 if error is None else 1

    def _abort_the_rest(self) -> None:
        """A stopped core holds nothing: requests its serving process had not ended (their aborts may
        have come just before the stop) are aborted, their blocks freed; an in-process core's engine
        serves on after it (EngineCoreClient.in_process)."""
        scheduler = self.engine.scheduler
        for request_id in [*scheduler.requests, *scheduler.awaiting_room, *scheduler.held]:
            self.engine.abort_request(request_id)

    def _ready(self) -> pb.CoreReady:
        e = self.engine
        return pb.CoreReady(
            block_size=e.runtime.block_size,
            max_model_len=e.runtime.max_model_len,
            vocab_size=e.vocab_size,
            tensor_parallel_size=e.runner.tp.size,
            num_kv_heads=e.runner.arch.num_kv_heads,
            load=load_to_proto(engine_load(e)),
            num_threads=torch.get_num_threads(),
        )

    # -- the pipe -----------------------------------------------------------------------------------
    def _send(self, event: pb.CoreEvent) -> None:
        self._events.put(event.SerializeToString())

    def _pipe_lost(self, error: OSError) -> None:
        """On the event writer: the serving process is gone, nobody reads outputs any more."""
        self._stop()

    def _stop(self) -> None:
        self.closing.set()
        self.outputs.close()  # a step loop waiting for an acknowledgement (a stop string's) goes on
        self.steps.wake()

    def _read_commands(self) -> None:
        while not self.closing.is_set():
            try:
                command = pb.CoreCommand.FromString(self.conn.recv_bytes())
            except (EOFError, OSError):  # the serving process closed the pipe or died
                log.info("the serving process is gone; stopping the engine core")
                break
            if not self._apply(command):
                break
        self._stop()

    def _apply(self, command: pb.CoreCommand) -> bool:
        """Queue one command for the step loop; False once told to shut down."""
        kind = command.WhichOneof("command")
        if kind == "add":
            request = self._request(command.add)
            if request is None:
                pass
            elif command.add.HasField("generate") and not command.add.generate.prefill_address:
                self.steps.post(self._add, request)
            elif self.handoffs is None:
                self._refuse(request.request_id, "this engine core moves no KV (not a prefill or decode worker's)")
            else:
                self._start_handoff(request, command.add)
        elif kind == "abort_request_id":  # one place: the engine ends all it holds (its handoff too)
            self.steps.post(self.engine.abort_request, command.abort_request_id)
            self.steps.post(self._report_load)  # its blocks are free now, even if no step follows
        elif kind == "query" and command.query.kind == pb.CORE_QUERY_KIND_METRICS:
            self._send(pb.CoreEvent(reply=pb.CoreReply(call_id=command.query.call_id, metrics=self._exposition())))
        elif kind == "query":
            self.steps.post(self._answer, command.query)
        elif kind == "processed":
            self.outputs.processed(command.processed)  # here: the step loop may be waiting for it
        elif kind == "shutdown":
            return False
        return True

    # -- the reader's side --------------------------------------------------------------------------
    def _request(self, add: pb.CoreAddRequest) -> Request | None:
        """A validated request, or None after refusing it (its stream ends with the reason)."""
        prefill = add.HasField("prefill")
        call = add.prefill.request if prefill else add.generate
        try:
            return self.engine.make_request(
                list(call.prompt_token_ids),
                params_from_proto(call.params),
                add.request_id,
                call.priority,
                stop_after_prefill=prefill,  # it keeps its blocks for the decode worker
                label=call.request_id,
                output_token_ids=call.continuation.output_token_ids,
            )
        except ValueError as e:
            self._refuse(add.request_id, str(e))
            return None
        except Exception as e:  # a bug: this request ends, the reader reads on (else every stream would wait)
            log.exception("request %s: the engine core could not take it", add.request_id)
            self._send(
                refusal(add.request_id, f"the engine core could not take it ({type(e).__name__}: {e})", "INTERNAL")
            )
            return None

    def _refuse(self, request_id: str, message: str) -> None:
        self._send(refusal(request_id, message))

    def _start_handoff(self, request: Request, add: pb.CoreAddRequest) -> None:
        assert self.handoffs is not None
        try:
            self.handoffs.start(request, add)
        except Exception as e:  # a bug: this request ends, the reader reads on (else the core would stop)
            log.exception("request %s: its handoff did not start", request.request_id)
            message = f"the KV handoff did not start ({type(e).__name__}: {e})"
            self._send(refusal(request.request_id, message, "INTERNAL"))

    def _exposition(self) -> bytes:
        """The registry in Prometheus' text format (its metrics are thread-safe: read here, at once)."""
        return generate_latest(self.metrics)

    def _load_clock(self) -> None:
        while not self.closing.wait(LOAD_INTERVAL_S):
            self.steps.post(self._report_load)

    # -- the step loop's side -----------------------------------------------------------------------
    def _add(self, request: Request) -> None:
        try:
            self.engine.add_request(request)
        except ValueError as e:  # its id is in use: the serving process names requests uniquely
            self._refuse(request.request_id, str(e))

    def _answer(self, query: pb.CoreQuery) -> None:
        pool = self.engine.kv.pool
        reply = pb.CoreReply(call_id=query.call_id)
        if query.kind == pb.CORE_QUERY_KIND_KV_SNAPSHOT:
            reply.block_hashes.extend(pool.cached_hashes())
        reply.events.extend(kv_events_to_proto(pool.drain_events()))
        self._send(pb.CoreEvent(reply=reply))

    def _report_load(self) -> None:
        load = engine_load(self.engine)
        full = load_to_proto(load)
        now = time.monotonic()
        if full != self._last_load or now - self._last_load_at >= KEEPALIVE_S:
            self._last_load, self._last_counts = full, load_to_proto(load, with_steps=False)
            self._last_load_at = now
            self._send(pb.CoreEvent(load=full))

    def _changed_counts(self) -> pb.CoreLoad | None:
        """On the step loop, after a step: the load's counts if they changed since last sent (~20 us)."""
        counts = load_to_proto(engine_load(self.engine), with_steps=False)
        if counts == self._last_counts:
            return None
        self._last_counts = counts
        return counts


class PipeOutputs:
    """The engine's output sink: the step tokens leave for the serving process, which processes them
    (services/engine/core_client.py) and acknowledges each step with the requests to finish; the engine
    waits for an acknowledgement only where a stop string must end its request within one step. The
    serving process tracks its requests itself (their arrivals and aborts never come here). Calls
    come from the step loop, in step order."""

    def __init__(
        self,
        send: Callable[[pb.CoreEvent], None],
        report: Callable[[list[tuple[str, RequestStatus]]], None],
        counts: Callable[[], pb.CoreLoad | None] = lambda: None,
        tap: Callable[[StepTokens], None] | None = None,
        wait_for_room: Callable[[], None] = lambda: None,
    ):
        """wait_for_room: blocks the step loop while the pipe's queue is full."""
        self._send, self._report, self._counts, self._tap = send, report, counts, tap
        self._wait_for_room = wait_for_room
        self._num_submitted = 0  # the step loop's
        self._num_processed = 0
        self._closed = False
        self._changed = threading.Condition()

    def submit(self, step: StepTokens) -> int:
        """On the step loop: waits while the serving process is a queue's worth of events behind."""
        self._wait_for_room()
        if self._tap is not None:  # outputs made here (a prefill worker's prompts) first
            self._tap(step)
        self._num_submitted += 1
        msg = step_tokens_to_proto(step, self._num_submitted)
        counts = self._counts()
        if counts is not None:
            msg.load.CopyFrom(counts)
        self._send(pb.CoreEvent(step_tokens=msg))
        return self._num_submitted

    def wait(self, ticket: int) -> None:
        """Until the step with this ticket went through (or the sink closed)."""
        with self._changed:
            self._changed.wait_for(lambda: self._num_processed >= ticket or self._closed)

    def close(self) -> None:
        """Stop: a step loop waiting for an acknowledgement goes on (what is queued is on the pipe)."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()

    def processed(self, msg: pb.CoreProcessed) -> None:
        """From the command reader: finish what the step's processing ended, then release waiters."""
        stopped = [(rid, RequestStatus.FINISHED_STOPPED) for rid in msg.stopped_request_ids]
        self._report(stopped + [(rid, RequestStatus.FINISHED_ABORTED) for rid in msg.failed_request_ids])
        with self._changed:
            self._num_processed = max(self._num_processed, msg.ticket)
            self._changed.notify_all()
