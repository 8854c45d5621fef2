"""Output processing: from a step's token ids to the RequestOutputs callers stream.

Per request: incremental detokenization, stop strings, logprobs formatting, timings and the
RequestOutput itself. OutputProcessor keeps its own per-request state and is fed in step order
(`add` when a request arrives, `process` after each step, `abort` when one is aborted). It runs
inline (a bare Engine.step returns its outputs: LLM) or in the serving process of an engine core
(services/engine/core_client.py, as vLLM v1's frontend and SGLang's detokenizer manager run apart
from their schedulers), behind the core's pipe: the step loop hands over the token ids and starts
the next step at once.

Stop strings are found here, after the engine may have moved on: `process` returns the requests
to finish (ProcessedStep.to_finish) and the engine finishes them before its next schedule; behind
a sink the engine waits, before scheduling step N + 2, until step N went through here, so a stop
string still ends its request within one step. A request's final output is its last:
a token the engine computed for it meanwhile is dropped, never streamed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from splitserve.common.tokenizer import Tokenizer
from splitserve.services.engine.detokenizer import IncrementalDetokenizer
from splitserve.services.engine.outputs import Finish, OutputRequest, RequestOutput, RequestTimings, StepTokens
from splitserve.services.engine.request import FinishReason, RequestStatus

log = logging.getLogger("splitserve.services.engine")
# Processing off the step loop (a core client's reader) offers the GIL back every this many requests
# (~0.1 ms of work on this CPU).
_REQUESTS_BETWEEN_PAUSES = 32


@dataclass(slots=True)
class ProcessedStep:
    outputs: list[RequestOutput] = field(default_factory=list)
    # Requests the engine must finish: a stop string matched (FINISHED_STOPPED) or their output
    # processing failed (FINISHED_ABORTED, error in their output).
    to_finish: list[tuple[str, RequestStatus]] = field(default_factory=list)


class _Tracked:
    """A request's output state: its detokenizer, counts and times."""

    __slots__ = ("request", "detokenizer", "arrival", "first_token", "scheduled_step", "num_output_tokens", "timings")

    def __init__(self, request: OutputRequest, detokenizer: IncrementalDetokenizer, arrival: float) -> None:
        self.request = request  # read for fields fixed before its first token (prompt, cached tokens)
        self.detokenizer = detokenizer
        self.arrival = arrival
        self.first_token: float | None = None
        self.scheduled_step: float | None = None  # when the token of its first scheduled step was known
        self.num_output_tokens = 0  # tokens processed here (the engine may be a step ahead)
        self.timings: RequestTimings | None = None  # fixed once scheduled and with its first token


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._tracked: dict[str, _Tracked] = {}

    def add(self, request: OutputRequest, arrival: float, num_text_chars_sent: int = 0) -> None:
        """Track a request before its first step (its tokens then never change, whatever thread reads
        them). Output tokens it already has are a migrated stream's: their text is decoded here, and
        what follows the num_text_chars_sent characters its client has goes out with the next token."""
        tokens, num_prompt = request.all_token_ids, request.num_prompt_tokens
        detokenizer = IncrementalDetokenizer(self.tokenizer, request.sampling_params, tokens[:num_prompt])
        tracked = self._tracked[request.request_id] = _Tracked(request, detokenizer, arrival)
        if len(tokens) > num_prompt:
            detokenizer.resume(tokens[num_prompt:], num_text_chars_sent)
            tracked.num_output_tokens = len(tokens) - num_prompt

    def abort(self, request_id: str) -> RequestOutput | None:
        """An aborted request's final output (finish reason abort), or None if it already had one;
        tokens the engine computed for it meanwhile are dropped."""
        t = self._tracked.pop(request_id, None)
        return None if t is None else _ended(t)

    def process(self, step: StepTokens, pause: Callable[[], None] | None = None) -> ProcessedStep:
        """The step's outputs; pause() is called between runs of requests (a core client's reader
        yields the GIL there, so that an in-process core's step loop never waits long for it)."""
        done = ProcessedStep()
        tracked, finished, outputs = self._tracked, step.finished, done.outputs
        for i, (request, token_id) in enumerate(zip(step.requests, step.token_ids)):
            if pause is not None and i % _REQUESTS_BETWEEN_PAUSES == _REQUESTS_BETWEEN_PAUSES - 1:
                pause()
            t = tracked.get(request.request_id)
            if t is None:  # finished here already (a stop string) or aborted: drop the token
                continue
            try:
                outputs.append(self._output(t, token_id, finished.get(request.request_id), step, done))
            except Exception as e:  # isolation boundary: e.g. detokenizing this request's tokens
                log.exception("output processing failed for request %s", request.request_id)
                done.to_finish.append((request.request_id, RequestStatus.FINISHED_ABORTED))
                outputs.append(self._failure(t, e))
        for request, message in step.failed:
            t = tracked.get(request.request_id)
            if t is not None:  # else its final output went out already (a stop string one step before)
                outputs.append(self._failure(t, message))
        return done

    def _output(
        self, t: _Tracked, token_id: int, finish: Finish | None, step: StepTokens, done: ProcessedStep
    ) -> RequestOutput:
        request = t.request
        rid = request.request_id
        t.num_output_tokens += 1
        if t.first_token is None:
            t.first_token = step.time
        if t.scheduled_step is None and request.first_scheduled_time is not None:
            t.scheduled_step = step.time
        detok = t.detokenizer
        stop = detok.add_tokens([token_id])
        if stop is not None:  # a stop string wins over whatever else ended the request this step
            if finish is None:
                done.to_finish.append((rid, RequestStatus.FINISHED_STOPPED))
            finish = Finish(FinishReason.STOP, None, finish.handoff if finish else None)
        if finish is not None:
            detok.flush()
            del self._tracked[rid]
        logprobs = step.logprobs.get(rid) if step.logprobs is not None else None
        return RequestOutput(
            request_id=rid,
            new_token_ids=[token_id],
            new_text=detok.take_delta(finish is not None),
            finished=finish is not None,
            finish_reason=finish.reason if finish else None,
            stop_reason=stop if stop is not None else (finish.stop_reason if finish else None),
            new_logprobs=[logprobs] if logprobs is not None else None,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=t.num_output_tokens,
            num_cached_tokens=request.num_cached_tokens,
            timings=t.timings or _timings(t),
            handoff=finish.handoff if finish else None,
            stages=_stages(t) if finish else None,
        )

    def _failure(self, t: _Tracked, error: Exception | str) -> RequestOutput:
        """The final output of a request the engine failed on (it was stopped, its blocks freed)."""
        self._tracked.pop(t.request.request_id, None)
        if isinstance(error, Exception):
            error = f"{type(error).__name__}: {error}"
        message = f"the engine failed on this request ({error}); it was stopped and its KV blocks freed; "
        return _ended(t, message + "the worker goes on")


def _ended(t: _Tracked, error: str | None = None) -> RequestOutput:
    """The final output of a request stopped before it finished: aborted, or failed (error)."""
    request = t.request
    return RequestOutput(
        request_id=request.request_id,
        new_token_ids=[],
        new_text="",
        finished=True,
        finish_reason=FinishReason.ABORT,
        num_prompt_tokens=request.num_prompt_tokens,
        num_output_tokens=t.num_output_tokens,
        num_cached_tokens=request.num_cached_tokens,
        timings=_timings(t),
        error=error,
        stages=_stages(t),
    )


def _stages(t: _Tracked) -> dict[str, float] | None:
    """A handed-off request's stages (on its final output); None for one computed here."""
    times = t.request.handoff_times
    return None if times is None else times.stages(t.request.first_scheduled_time, t.scheduled_step)


def _timings(t: _Tracked) -> RequestTimings:
    scheduled = t.request.first_scheduled_time
    ttft = (t.first_token - t.arrival) * 1e3 if t.first_token is not None else None
    timings = RequestTimings(queue_ms=((scheduled or t.arrival) - t.arrival) * 1e3, ttft_ms=ttft)
    if scheduled is not None and ttft is not None:  # neither changes any more
        t.timings = timings
    return timings


def yield_gil() -> None:
    time.sleep(0)  # releases the GIL: a waiting step loop takes it now, not after the switch interval
