"""The engine: validate and add requests, then step (schedule -> forward -> sample -> update).

Lifecycle of a request (unified mode): waiting -> running -> finished (preempted -> waiting).
Disaggregated tiers use the same engine: the prefill tier finishes a request at its first token
and holds its blocks until sent (`held_blocks`, `release_held`); the decode tier reserves blocks,
takes the first token from the prefill worker, then admits the request once its KV has landed
(`queue_reservation`, `accept_first_token`, `admit_transferred`, `recompute_locally`).

Output processing (detokenization, stop strings, logprobs formatting, the RequestOutputs) is
services/engine/output_processor.py, fed with each step's token ids (StepTokens): inline, so that step()
returns the outputs (LLM), or by a sink (an engine core's pipe to its serving process, which
processes them there), so that the next step starts as soon as the sampled ids are known.

Ids: the engine names requests itself (`req-N`, unique for the life of the process); a client's id
is only a label. Held blocks live under a lease (services/engine/leases.py).

Failures: an exception in the forward fails the requests of that batch; one in a request's own
sampling or output processing fails that request only. Either way they finish with an error
(RequestOutput.error), their blocks are freed and the engine goes on. An exception in scheduling
or bookkeeping leaves state that cannot be trusted: it propagates and the worker must exit.

Each step that ran its forward is counted in step_stats (services/engine/step_stats.py: its kind, wall time,
sequences, tokens and context), what the planner refits its performance model on.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch

from splitserve.common.sampling_params import SamplingParams
from splitserve.common.tokenizer import Tokenizer
from splitserve.services.engine.config import EngineConfig, RuntimeInfo
from splitserve.services.engine.kv_cache.block_pool import BlockId
from splitserve.services.engine.kv_cache.manager import KVCacheManager
from splitserve.services.engine.layer_progress import LayerProgress
from splitserve.services.engine.leases import HeldLeases
from splitserve.services.engine.model_runner import ModelRunner, WarmUpReport
from splitserve.services.engine.output_processor import OutputProcessor, ProcessedStep
from splitserve.services.engine.outputs import (  # noqa: F401  (re-exported: the engine's public output types)
    Finish,
    PrefillHandoff,
    RequestOutput,
    RequestTimings,
    StepTokens,
    merge_outputs,
)
from splitserve.services.engine.ranks import RanksLost
from splitserve.services.engine.request import HandoffTimes, Request, RequestId, RequestStatus
from splitserve.services.engine.sampler import Sampler, TokenLogprobs
from splitserve.services.engine.scheduler import Scheduler
from splitserve.services.engine.scheduler_output import SchedulerOutput
from splitserve.services.engine.step_inputs import ForwardBatch
from splitserve.services.engine.step_stats import StepStats
from splitserve.services.model.loader import open_model

if TYPE_CHECKING:
    from splitserve.services.engine.core_process import PipeOutputs

PromptInput = str | Sequence[int]
log = logging.getLogger("splitserve.services.engine")


@dataclass(slots=True)
class EngineStats:
    """Cumulative counters for metrics."""

    num_failed_requests: int = 0  # finished with an error by a failed step


class Engine:
    def __init__(self, config: EngineConfig | None = None) -> None:
        config = config or EngineConfig()
        self.config = config
        source = open_model(config.model)
        self.tokenizer: Tokenizer = source.tokenizer
        max_model_len = min(
            config.max_model_len or source.arch.max_position_embeddings, source.arch.max_position_embeddings
        )
        self.runner = ModelRunner(config, source, max_model_len)
        self.runtime = RuntimeInfo(
            num_kv_blocks=self.runner.num_blocks,
            block_size=config.cache.block_size,
            max_model_len=max_model_len,
            eos_token_ids=self.tokenizer.eos_token_ids,
        )
        self.kv = KVCacheManager(
            self.runner.num_blocks,
            config.cache.block_size,
            config.cache.enable_prefix_caching,
            max_blocks_per_request=-(-max_model_len // config.cache.block_size),
        )
        self.scheduler = Scheduler(config.scheduler, self.runtime, self.kv)
        self.sampler = Sampler(config.seed)
        self.leases = HeldLeases(config.cache.kv_lease_s)
        self.stats = EngineStats()
        self.step_stats = StepStats()  # what each kind of step costs (the planner's refit)
        self._outputs = OutputProcessor(self.tokenizer)
        self._sink: PipeOutputs | None = None  # where step tokens go when not processed inline
        # Requests the output processor asks to finish (stop strings, failures), applied before a
        # schedule; appended from the sink's thread (deque appends are atomic).
        self._to_finish: deque[tuple[str, RequestStatus]] = deque()
        self._recent_tickets: deque[int] = deque(maxlen=2)  # the sink's tickets of the last two steps
        self._stop_string_ids: set[str] = set()  # unfinished requests with stop strings
        # Prefill tier, during a step: requests whose KV a sender reads as this step computes it; their
        # blocks were claimed at schedule (no lease: only the sender's release_held frees them).
        self._streaming: set[str] = set()
        self._to_stream: set[str] = set()  # unfinished requests whose kv_stream is not called yet
        # Held by a thread that runs a step loop (an in-process core's), so that one ending still and
        # a new one (a later client's, in tests) never step this engine at once.
        self.loop_lock = threading.Lock()
        self._ids = itertools.count()
        # What a request runs outside the engine that its abort must end (a core's KV handoff task),
        # while it runs: an abort reaches the engine only, which ends the rest (run_outside).
        self._outside: dict[str, Callable[[], None]] = {}
        self._outside_lock = threading.Lock()

    # -- requests -----------------------------------------------------------------------------
    def tokenize(self, prompt: PromptInput) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty; send at least one character or token")
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def make_request(
        self,
        prompt: PromptInput,
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
        stop_after_prefill: bool = False,
        label: str = "",
        output_token_ids: Sequence[int] = (),
    ) -> Request:
        """Validate a request without touching engine state (safe from any thread).

        request_id None (what servers pass) names it `req-N`; an in-process caller's own id must
        not be in use when the request is added. label is the client's id, echoed in logs only.
        output_token_ids: a migrated stream's tokens so far (splitserve.v1.Continuation), computed here
        with the prompt and counted as its output.
        """
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        token_ids = self.tokenize(prompt)
        self._validate_tokens(token_ids)
        params.check_token_ids(self.vocab_size)
        rt = self.runtime
        max_tokens = params.max_tokens or rt.max_model_len - len(token_ids)
        if len(token_ids) + max_tokens > rt.max_model_len:
            raise ValueError(
                f"prompt ({len(token_ids)} tokens) + max_tokens ({max_tokens}) exceeds the "
                f"model context of {rt.max_model_len} tokens; lower max_tokens or shorten the prompt"
            )
        if len(token_ids) + max_tokens > rt.kv_capacity_tokens:
            raise ValueError(
                f"prompt ({len(token_ids)} tokens) + max_tokens ({max_tokens}) can never fit the KV "
                f"cache of {rt.kv_capacity_tokens} tokens; lower max_tokens or raise --kv-cache-bytes"
            )
        self._check_schedulable(len(token_ids) + (1 if stop_after_prefill else max_tokens))
        self._check_continuation(output_token_ids, max_tokens)
        rid = RequestId(request_id if request_id is not None else f"req-{next(self._ids)}")
        request = Request(
            rid,
            token_ids,
            params,
            max_tokens=max_tokens,
            eos_token_ids=rt.eos_token_ids,
            block_size=rt.block_size,
            priority=priority,
            stop_after_prefill=stop_after_prefill,
            label=label,
        )
        for token_id in output_token_ids:
            request.append_output_token(token_id)
        return request

    def _check_continuation(self, output_token_ids: Sequence[int], max_tokens: int) -> None:
        if len(output_token_ids) >= max_tokens:
            raise ValueError(
                f"the stream to continue already has {len(output_token_ids)} output tokens, "
                f"as many as its max_tokens ({max_tokens}); it has nothing left to generate"
            )
        self._check_vocab(output_token_ids, "continuation token ids")

    def _check_schedulable(self, max_num_tokens: int) -> None:
        """Without chunked prefill a request (recomputed after preemption: prompt and output) must fit
        one step's token budget, or it would wait forever at the head of the queue."""
        sched = self.config.scheduler
        if not sched.enable_chunked_prefill and max_num_tokens > sched.max_num_batched_tokens:
            raise ValueError(
                f"prompt + max_tokens ({max_num_tokens} tokens) exceeds max_num_batched_tokens "
                f"({sched.max_num_batched_tokens}) and chunked prefill is off; shorten the request "
                "or start the worker with chunked prefill or a larger --max-num-batched-tokens"
            )

    def _validate_tokens(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("prompt is empty; send at least one character or token")
        if len(token_ids) >= self.runtime.max_model_len:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens but the model context is "
                f"{self.runtime.max_model_len}; shorten the prompt"
            )
        self._check_vocab(token_ids, "prompt token ids")

    def _check_vocab(self, token_ids: Sequence[int], what: str) -> None:
        vocab = self.runner.arch.vocab_size
        bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"{what} must be in [0, {vocab}); got {bad[:5]}")

    def add_request(
        self,
        prompt: PromptInput | Request,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
    ) -> str:
        request = (
            prompt
            if isinstance(prompt, Request)
            else self.make_request(prompt, params or SamplingParams(), request_id, priority)
        )
        self._check_unused(request.request_id)
        self.scheduler.add_request(request)
        self._track(request)
        if request.kv_stream is not None:
            self._to_stream.add(request.request_id)
        return request.request_id

    def _check_unused(self, request_id: str) -> None:
        """An id is in use while its request is unfinished or owns blocks (held, reserved or parked)."""
        s = self.scheduler
        if (
            request_id in s.requests
            or request_id in s.awaiting_room
            or self.kv.holds(request_id)
            or self.kv.is_parked(request_id)
        ):
            raise ValueError(f"request id {request_id!r} is already in use")

    def run_outside(self, request_id: str, end: Callable[[], None]) -> None:
        """From any thread: request_id runs work outside the engine (a KV handoff task) until
        done_outside; an abort meanwhile calls end() (thread-safe: it must not wait), so the request's
        abort goes to one place, here."""
        with self._outside_lock:
            self._outside[request_id] = end

    def done_outside(self, request_id: str) -> None:
        """From any thread: request_id's work outside the engine has ended."""
        with self._outside_lock:
            self._outside.pop(request_id, None)

    def abort_request(self, request_id: str) -> bool:
        """Stop a request now and free its KV blocks (held ones too, unless their send has started),
        and end what it runs outside the engine (run_outside).

        False if it is unknown or already done."""
        with self._outside_lock:
            end = self._outside.pop(request_id, None)
        if end is not None:
            end()
        request = self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
        self._forget(request_id)
        if self._sink is None:  # else its serving process ended the stream (an inline caller gets nothing)
            self._outputs.abort(request_id)
        if request is None and self._release_unclaimed(request_id):  # finished and held, nobody sending yet
            return True
        return request is not None

    def _release_unclaimed(self, request_id: str) -> bool:
        """Free a held request's blocks unless a sender claimed them (then its release frees them)."""
        return self.leases.claim(request_id) and self.scheduler.release_held(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def has_work(self) -> bool:
        """Whether step() would run anything (requests awaiting KV cannot run yet)."""
        return self.scheduler.has_work()

    # -- prefill tier ---------------------------------------------------------------------------
    def claim_held(self, request_id: str) -> bool:
        """The sender starts reading the held blocks: from now on only release_held frees them.
        False if they are gone (lease expired, or the request was aborted)."""
        return self.leases.claim(request_id)

    def release_held(self, request_id: str) -> bool:
        """The prompt's blocks were sent (or the send failed): back to the pool, kept as prefix cache."""
        self.leases.drop(request_id)
        return self.scheduler.release_held(request_id)

    def expire_leases(self, now: float | None = None) -> int:
        """Free held blocks whose lease ran out unclaimed; returns how many requests that freed."""
        expired = self.leases.expire(now)
        for request_id in expired:
            log.warning(
                "request %s: held KV blocks not claimed within %.1f s; released", request_id, self.leases.lease_s
            )
            self.scheduler.release_held(request_id)
        return len(expired)

    def num_held_blocks(self) -> int:
        # A copy of the ids: the event loop asks while the step thread may finish requests.
        return sum(self.kv.num_blocks_of(rid) for rid in list(self.scheduler.held))

    # -- decode tier ----------------------------------------------------------------------------
    def queue_reservation(self, request: Request, reserved: Callable[[int], None]) -> None:
        """Reserve the prompt's blocks (Scheduler.reserve_for_transfer) now, or once room is freed
        (reserve_queued, each turn of the step loop), after those queued before it; reserved(num_held),
        the number already held here, runs on the step loop once made. Its abort withdraws it."""
        self._check_unused(request.request_id)

        def made(num_held: int) -> None:
            self._track(request)
            reserved(num_held)

        self.scheduler.queue_reservation(request, made)

    def reserve_queued(self) -> None:
        """Make the queued reservations that fit now (blocks freed since: a step, a landing, an abort)."""
        self.scheduler.reserve_queued()

    def accept_first_token(
        self,
        request_id: str,
        token_id: int,
        logprobs: TokenLogprobs | None,
        prefill_ms: tuple[float, float] = (0.0, 0.0),
    ) -> None:
        """The prefill worker's first token: append it, check stops; the
        token goes to the outputs like a step's. prefill_ms: the prefill worker's queue and compute
        times (the request's first stages). Nothing if the request is gone (aborted meanwhile)."""
        request = self.scheduler.awaiting_kv.get(request_id)
        if request is None:
            return
        request.append_output_token(token_id)
        now = time.monotonic()
        request.handoff_times = HandoffTimes(*prefill_ms, first_token_time=now)
        finished = {}
        status = request.check_stop(self.runtime.max_model_len)
        if status is not None:
            self.scheduler.finish_request(request_id, status)
            finished[request_id] = self._finished(request)
        lookup = {request_id: logprobs} if logprobs is not None else None
        self._emit(StepTokens([request], [token_id], finished, now, lookup))

    def admit_transferred(self, request_id: str, num_held: int, write: Callable[[Sequence[int]], None]) -> bool:
        """Write the received KV (write(block_ids): the reserved blocks after the num_held already
        here), then let the request run.

        False (nothing written) if the request is gone: its reserved blocks may be reused already.
        """
        if request_id not in self.scheduler.awaiting_kv:
            return False
        write(self.kv.block_ids(request_id)[num_held:])
        self.scheduler.admit_transferred(request_id)
        return True

    def pin_reserved(self, request_id: str, num_held: int) -> list[BlockId] | None:
        """Thread-safe: the reserved blocks after the num_held already here, which a transfer may now
        write as its bytes arrive (Scheduler.pin_reserved: they are not reused before unpin); None
        if the reservation is gone."""
        if not self.scheduler.pin_reserved(request_id):
            return None
        return self.kv.block_ids(request_id)[num_held:]

    def unpin(self, request_id: str) -> None:
        """Every write of a pinned reservation's transfer has ended (between steps)."""
        self.scheduler.unpin(request_id)

    def recompute_locally(self, request_id: str) -> bool:
        if request_id not in self.scheduler.awaiting_kv:
            return False
        self.scheduler.recompute_locally(request_id)
        return True

    # -- the step -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run the forward, sample and update; then process the outputs.

        Returns the step's outputs, or [] while an output sink takes them (start_output_sink):
        then this returns as soon as the sampled ids are known.
        """
        self._before_schedule()
        tokens = self._step_tokens()
        return [] if tokens is None else self._emit(tokens)

    def _emit(self, tokens: StepTokens) -> list[RequestOutput]:
        """Tokens to the outputs: processed here (and returned), or handed to the sink."""
        if self._sink is None:
            done = self._outputs.process(tokens)
            self._apply(done)
            return done.outputs
        self._recent_tickets.append(self._sink.submit(tokens))
        return []

    def _before_schedule(self) -> None:
        """Finish what output processing asked for; with a sink, first wait until it has processed
        the step before last, so that a stop string ends its request within one step."""
        sink = self._sink
        if sink is not None and self._stop_string_ids and len(self._recent_tickets) == 2:
            sink.wait(self._recent_tickets[0])
        while self._to_finish:
            self._finish_for_outputs(*self._to_finish.popleft())

    def _step_tokens(self) -> StepTokens | None:
        started = time.monotonic()
        out = self.scheduler.schedule()
        if out.is_empty:
            return None
        layers = self._start_streams(out)
        try:
            batch, logits = self._compute(out, layers)
        except RanksLost:  # not this batch's fault: the worker's ranks are out of step for good
            raise
        except Exception as e:  # isolation boundary: a failed forward fails its batch, not the engine
            scheduled = out.decodes + [s.request for s in out.chunks]
            log.exception("the forward failed; failing the %d requests of this batch", len(scheduled))
            failed = [self._fail(r, e) for r in scheduled]
            self._streaming.clear()
            return StepTokens([], [], {}, time.monotonic(), failed=failed)
        result = self.sampler.sample(logits, batch.sampling_requests)
        failed = [self._fail(r, e) for r, e in result.errors]  # before the update skips them
        update = self.scheduler.update(out, result.token_ids)
        now = time.monotonic()
        arrays = batch.arrays  # always there from prepare (None only for the runner's own shapes)
        if arrays is not None:
            self.step_stats.record(arrays.starts, arrays.query_lens, len(arrays.input_ids), now - started)
        finished: dict[str, Finish] = {r.request_id: self._finished(r) for r in update.finished}
        self._streaming.clear()  # each finished (held) or failed (held for its sender) above
        advanced = update.advanced
        # Every sampled request advanced (nothing failed or was aborted): the sampled ids line up.
        aligned = len(advanced) == len(result.token_ids)
        return StepTokens(
            requests=advanced,
            token_ids=cast(list[int], result.token_ids) if aligned else [r.all_token_ids[-1] for r in advanced],
            finished=finished,
            time=now,
            logprobs=result.rows,
            failed=failed,
        )

    def _compute(self, out: SchedulerOutput, layers: LayerProgress | None) -> tuple[ForwardBatch, torch.Tensor]:
        """The step's inputs and logits; if either fails, so do the senders waiting for its layers."""
        try:
            batch = self.runner.prepare(out)
            return batch, self.runner.forward(batch, layers)
        except BaseException as e:
            if layers is not None:
                layers.fail(e)
            raise

    def _start_streams(self, out: SchedulerOutput) -> LayerProgress | None:
        """Prefill tier: requests streaming their KV (Request.kv_stream) whose last prompt chunk runs
        in this step get their blocks and the step's progress before its forward; from now on only
        their sender frees the blocks. None when no such request runs."""
        if not self._to_stream:
            return None
        scheduled = out.decodes + [s.request for s in out.chunks if s.samples]  # a last chunk may be one token
        streamed = [r for r in scheduled if r.request_id in self._to_stream]
        if not streamed:
            return None
        layers = LayerProgress(self.runner.arch.num_layers, self.runner.device)
        for request in streamed:
            self._to_stream.remove(request.request_id)  # so its hook runs once
            self._streaming.add(request.request_id)
            assert request.kv_stream is not None
            request.kv_stream(self.kv.block_ids(request.request_id)[: request.num_prompt_blocks], layers)
        return layers

    def _finished(self, request: Request) -> Finish:
        """Wrap up a request that finished at this step (the prefill tier's held blocks start their
        lease, unless a sender streaming them claimed them already)."""
        rid = request.request_id
        handoff = None
        if request.stop_after_prefill and rid in self.scheduler.held:
            handoff = PrefillHandoff(self.kv.block_ids(rid))
            if rid not in self._streaming:
                self.leases.start(rid)
        self._forget(rid)
        reason = request.finish_reason
        assert reason is not None
        return Finish(reason, request.stop_reason if isinstance(request.stop_reason, int) else None, handoff)

    def _fail(self, request: Request, error: Exception) -> tuple[Request, str]:
        """Finish a request the step failed for and free its blocks; returns the error for its stream."""
        rid = request.request_id
        # A sender streaming its KV may be reading the blocks: they stay held until it releases them.
        self.scheduler.finish_request(rid, RequestStatus.FINISHED_ABORTED, keep_blocks=rid in self._streaming)
        self._release_unclaimed(rid)  # finished at this step and already held: nobody will send
        self._forget(rid)
        self.stats.num_failed_requests += 1
        return request, f"{type(error).__name__}: {error}"

    def _apply(self, done: ProcessedStep) -> None:
        for request_id, status in done.to_finish:
            self._finish_for_outputs(request_id, status)

    def _finish_for_outputs(self, request_id: str, status: RequestStatus) -> None:
        """Output processing ended a request: a stop string matched, or processing it failed."""
        self.scheduler.finish_request(request_id, status)  # no-op if it finished meanwhile
        if status is RequestStatus.FINISHED_ABORTED:
            self._release_unclaimed(request_id)
            self.stats.num_failed_requests += 1
        self._forget(request_id)

    def _track(self, request: Request) -> None:
        if request.sampling_params.stop:
            self._stop_string_ids.add(request.request_id)
        if self._sink is None:  # else its serving process tracks it
            self._outputs.add(request, time.monotonic())

    def _forget(self, request_id: str) -> None:
        """Engine-side state of a request that finished here (its outputs may still be in processing)."""
        self._stop_string_ids.discard(request_id)
        self._to_stream.discard(request_id)

    # -- output sink ----------------------------------------------------------------------------
    def start_output_sink(self, sink: PipeOutputs) -> None:
        """Hand every step's tokens to sink from now on (step() returns []): a serving process's
        processor across a pipe (services/engine/core_process.py)."""
        if self._sink is not None:
            raise RuntimeError("an output sink is already set")
        self._sink = sink

    def finish_for_outputs(self, items: list[tuple[str, RequestStatus]]) -> None:
        """From any thread: output processing ended these requests (a stop string matched, or it
        failed); applied before the next schedule."""
        self._to_finish.extend(items)

    def stop_output_sink(self) -> None:
        """Let the sink deliver what is queued; outputs are returned by step() again."""
        sink, self._sink = self._sink, None
        self._recent_tickets.clear()
        if sink is not None:
            sink.close()

    def close(self) -> None:
        """Stop the output sink and the tensor-parallel ranks; the engine runs nothing more."""
        self.stop_output_sink()
        self.runner.close()

    def warm_up(self) -> WarmUpReport:
        """Run every kernel variant a step can hit, once, on a fresh engine (what a server does
        before it reports SERVING, so no request waits on a compile)."""
        return self.runner.warm_up()

    # -- introspection ------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.runner.arch.vocab_size

    def kv_usage(self) -> float:
        return self.kv.pool.usage()
