"""The engine: validate and add requests, then step (schedule -> forward -> sample -> update).

Lifecycle of a request (unified mode): waiting -> running -> finished (preempted -> waiting).
Disaggregated tiers use the same engine: the prefill tier finishes a request at its first token
and holds its blocks until sent (`held_blocks`, `release_held`); the decode tier reserves blocks,
takes the first token from the prefill worker, then admits the request once its KV has landed
(`reserve_for_transfer`, `accept_first_token`, `admit_transferred`, `recompute_locally`).

Ids: the engine names requests itself (`req-N`, unique for the life of the process); a client's id
is only a label. Held blocks live under a lease (engine/leases.py).

Failures: an exception in the forward fails the requests of that batch; one in a request's own
sampling or output processing fails that request only. Either way they finish with an error
(RequestOutput.error), their blocks are freed and the engine goes on. An exception in scheduling
or bookkeeping leaves state that cannot be trusted: it propagates and the worker must exit.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from splitserve.common.sampling_params import SamplingParams
from splitserve.common.tokenizer import Tokenizer
from splitserve.engine.config import EngineConfig, RuntimeInfo
from splitserve.engine.detokenizer import IncrementalDetokenizer
from splitserve.engine.kv_cache.manager import KVCacheManager
from splitserve.engine.leases import HeldLeases
from splitserve.engine.model_runner import ModelRunner, WarmUpReport
from splitserve.engine.request import FinishReason, Request, RequestId, RequestStatus
from splitserve.engine.sampler import Sampler, TokenLogprobs
from splitserve.engine.scheduler import Scheduler
from splitserve.model.loader import open_model

PromptInput = str | Sequence[int]
log = logging.getLogger("splitserve.engine")


@dataclass(frozen=True, slots=True)
class RequestTimings:
    """Engine-side times of one request, in ms from its arrival at this engine."""

    queue_ms: float = 0.0  # until first scheduled
    ttft_ms: float | None = None  # until its first token (None before it)


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one request: new tokens and text since the last output."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    new_logprobs: list[TokenLogprobs] | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    timings: RequestTimings = field(default_factory=lambda: RequestTimings())
    handoff: PrefillHandoff | None = None  # prefill tier, on the finished output
    error: str | None = None  # the step failed for this request (finished, aborted, blocks freed)


@dataclass(frozen=True, slots=True)
class PrefillHandoff:
    """What a prefill-tier request leaves for its decode worker (its blocks are held until sent)."""

    block_ids: Sequence[int]  # the prompt's blocks, in order
    sampler_state: bytes | None  # the request's seeded generator after the first sample


def merge_outputs(first: RequestOutput, later: RequestOutput) -> RequestOutput:
    """One output carrying both steps' tokens and text (the later one's status and counts)."""
    logprobs = None
    if first.new_logprobs is not None or later.new_logprobs is not None:
        logprobs = (first.new_logprobs or []) + (later.new_logprobs or [])
    return RequestOutput(
        request_id=later.request_id,
        new_token_ids=first.new_token_ids + later.new_token_ids,
        new_text=first.new_text + later.new_text,
        finished=later.finished,
        finish_reason=later.finish_reason,
        stop_reason=later.stop_reason,
        new_logprobs=logprobs,
        num_prompt_tokens=later.num_prompt_tokens,
        num_output_tokens=later.num_output_tokens,
        num_cached_tokens=later.num_cached_tokens,
        timings=later.timings,
        handoff=later.handoff,
        error=later.error,
    )


@dataclass(slots=True)
class EngineStats:
    """Cumulative counters for metrics."""

    num_failed_requests: int = 0  # finished with an error by a failed step


class _Tracked:
    """Engine-side companions of a request: its detokenizer and timestamps."""

    __slots__ = ("detokenizer", "arrival", "first_scheduled", "first_token")

    def __init__(self, detokenizer: IncrementalDetokenizer) -> None:
        self.detokenizer = detokenizer
        self.arrival = time.monotonic()
        self.first_scheduled: float | None = None
        self.first_token: float | None = None


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
        self.kv = KVCacheManager(self.runner.num_blocks, config.cache.block_size, config.cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.runtime, self.kv)
        self.sampler = Sampler(config.seed)
        self.leases = HeldLeases(config.cache.kv_lease_s)
        self.stats = EngineStats()
        self._tracked: dict[str, _Tracked] = {}
        self._ids = itertools.count()

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
    ) -> Request:
        """Validate a request without touching engine state (safe from any thread).

        request_id None (what servers pass) names it `req-N`; an in-process caller's own id must
        not be in use when the request is added. label is the client's id, echoed in logs only.
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
        rid = RequestId(request_id if request_id is not None else f"req-{next(self._ids)}")
        return Request(
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
        vocab = self.runner.arch.vocab_size
        bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids must be in [0, {vocab}); got {bad[:5]}")

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
        return request.request_id

    def _check_unused(self, request_id: str) -> None:
        """An id is in use while its request is tracked or owns blocks (held or reserved included)."""
        if request_id in self._tracked or self.kv.holds(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")

    def abort_request(self, request_id: str) -> bool:
        """Stop a request now and free its KV blocks (held ones too, unless their send has started).

        False if it is unknown or already done."""
        request = self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED)
        self._forget(request_id)
        if request is None and self.leases.claim(request_id):  # finished and held, nobody sending yet
            self.scheduler.release_held(request_id)
            return True
        return request is not None

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
        return sum(self.kv.num_blocks_of(rid) for rid in self.scheduler.held)

    # -- decode tier ----------------------------------------------------------------------------
    def reserve_for_transfer(self, request: Request) -> int | None:
        """Reserve the prompt's blocks; returns the number already held here, None when full."""
        self._check_unused(request.request_id)
        num_held = self.scheduler.reserve_for_transfer(request)
        if num_held is not None:
            self._track(request)
        return num_held

    def accept_first_token(
        self, request_id: str, token_id: int, logprobs: TokenLogprobs | None, sampler_state: bytes | None
    ) -> RequestOutput | None:
        """The prefill worker's first token: append it, carry the sampler over, check stops.

        Returns None if the request is gone (aborted meanwhile).
        """
        request = self.scheduler.awaiting_kv.get(request_id)
        if request is None:
            return None
        request.append_output_token(token_id)
        if sampler_state is not None:
            self.sampler.set_state(request_id, sampler_state)
        status = request.check_stop(self.runtime.max_model_len)
        if status is not None:
            self.scheduler.finish_request(request_id, status)
        return self._output(request, logprobs)

    def admit_transferred(self, request_id: str, num_held: int, blocks: torch.Tensor) -> bool:
        """Write the received blocks after the num_held already here, then let the request run.

        False (nothing written) if the request is gone: its reserved blocks may be reused already.
        """
        if request_id not in self.scheduler.awaiting_kv:
            return False
        block_ids = self.kv.block_ids(request_id)[num_held:]
        if len(block_ids) != blocks.shape[2]:
            raise ValueError(f"transfer carried {blocks.shape[2]} blocks for {len(block_ids)} reserved ones")
        self.runner.write_blocks(block_ids, blocks)
        self.scheduler.admit_transferred(request_id)
        return True

    def recompute_locally(self, request_id: str) -> bool:
        if request_id not in self.scheduler.awaiting_kv:
            return False
        self.scheduler.recompute_locally(request_id)
        return True

    # -- the step -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        out = self.scheduler.schedule()
        if out.is_empty:
            return []
        now = time.monotonic()
        for s in out.scheduled:
            tracked = self._tracked[s.request.request_id]
            tracked.first_scheduled = tracked.first_scheduled or now
        try:
            batch = self.runner.prepare(out)
            logits = self.runner.forward(batch)
        except Exception as e:  # isolation boundary: a failed forward fails its batch, not the engine
            log.exception("the forward failed; failing the %d requests of this batch", len(out.scheduled))
            return [self._fail(s.request, e) for s in out.scheduled]
        result = self.sampler.sample(logits, [s.request for s in batch.sampling])
        failed = [self._fail(r, e) for r, e in result.errors]  # before update_after_step skips them
        sampled: dict[str, int] = {
            s.request.request_id: t for s, t in zip(batch.sampling, result.token_ids) if t is not None
        }
        logprobs = {s.request.request_id: lp for s, lp in zip(batch.sampling, result.logprobs)}
        advanced = self.scheduler.update_after_step(out, sampled)
        return failed + [self._output_or_fail(r, logprobs[r.request_id]) for r in advanced]

    def _output_or_fail(self, request: Request, logprobs: TokenLogprobs | None) -> RequestOutput:
        try:
            return self._output(request, logprobs)
        except Exception as e:  # isolation boundary: e.g. detokenizing this request's tokens
            log.exception("output processing failed for request %s", request.request_id)
            return self._fail(request, e)

    def _fail(self, request: Request, error: Exception) -> RequestOutput:
        """Finish a request the step failed for: free its blocks, report the error to its stream."""
        rid = request.request_id
        self.scheduler.finish_request(rid, RequestStatus.FINISHED_ABORTED)
        self.release_held(rid)  # finished at this step and already held: nobody will send
        tracked = self._tracked.get(rid)
        self._forget(rid)
        self.stats.num_failed_requests += 1
        return RequestOutput(
            request_id=rid,
            new_token_ids=[],
            new_text="",
            finished=True,
            finish_reason=FinishReason.ABORT,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
            timings=_timings(tracked) if tracked else RequestTimings(),
            error=f"the engine failed on this request ({type(error).__name__}: {error}); it was stopped and "
            "its KV blocks freed; the worker goes on",
        )

    def _output(self, request: Request, logprobs: TokenLogprobs | None) -> RequestOutput:
        rid = request.request_id
        tracked = self._tracked[rid]
        tracked.first_token = tracked.first_token or time.monotonic()
        detok = tracked.detokenizer
        stop = detok.add_tokens([request.all_token_ids[-1]])
        if stop is not None:  # a stop string wins over whatever else ended the request this step
            self.scheduler.finish_request(rid, RequestStatus.FINISHED_STOPPED)  # no-op if already finished
            request.status, request.stop_reason = RequestStatus.FINISHED_STOPPED, stop
        handoff = None
        if request.is_finished:
            detok.flush()
            if request.stop_after_prefill and rid in self.scheduler.held:
                handoff = PrefillHandoff(self.kv.block_ids(rid), self.sampler.get_state(rid))
                self.leases.start(rid)
            self._forget(rid)
        return RequestOutput(
            request_id=rid,
            new_token_ids=[request.all_token_ids[-1]],
            new_text=detok.take_delta(request.is_finished),
            finished=request.is_finished,
            finish_reason=request.finish_reason,
            stop_reason=request.stop_reason,
            new_logprobs=[logprobs] if logprobs is not None else None,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
            num_cached_tokens=request.num_cached_tokens,
            timings=_timings(tracked),
            handoff=handoff,
        )

    def _track(self, request: Request) -> None:
        prompt = request.all_token_ids[: request.num_prompt_tokens]
        self._tracked[request.request_id] = _Tracked(
            IncrementalDetokenizer(self.tokenizer, request.sampling_params, prompt)
        )

    def _forget(self, request_id: str) -> None:
        self._tracked.pop(request_id, None)
        self.sampler.release(request_id)

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


def _timings(t: _Tracked) -> RequestTimings:
    ttft = (t.first_token - t.arrival) * 1e3 if t.first_token is not None else None
    return RequestTimings(queue_ms=((t.first_scheduled or t.arrival) - t.arrival) * 1e3, ttft_ms=ttft)
