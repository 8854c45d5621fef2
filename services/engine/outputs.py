"""What the engine hands out: a step's raw tokens (StepTokens, for the output processor) and the
per-request RequestOutputs built from them (services/engine/output_processor.py)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from splitserve.common.sampling_params import SamplingParams
from splitserve.services.engine.request import FinishReason, HandoffTimes
from splitserve.services.engine.sampler import TokenLogprobs


@dataclass(frozen=True, slots=True)
class RequestTimings:
    """Engine-side times of one request, in ms from its arrival at this engine."""

    queue_ms: float = 0.0  # until first scheduled
    ttft_ms: float | None = None  # until its first token (None before it)


@dataclass(frozen=True, slots=True)
class PrefillHandoff:
    """What a prefill-tier request leaves for its decode worker (its blocks are held until sent)."""

    block_ids: Sequence[int]  # the prompt's blocks, in order


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
    # Time by stage in ms, keyed as splitserve.v1.StageTimings' fields, on a handed-off request's
    # final output (HandoffTimes.stages); None: the worker derives them from timings.
    stages: dict[str, float] | None = None


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


@dataclass(frozen=True, slots=True)
class Finish:
    """How a request finished in the engine at a step (a stop string found later may overrule it)."""

    reason: FinishReason
    stop_reason: int | None = None  # the stop token id, if one ended it
    handoff: PrefillHandoff | None = None


class LogprobsSource(Protocol):
    """Where the output processor finds a request's logprobs for this step's token."""

    def get(self, request_id: str, /) -> TokenLogprobs | None: ...


class OutputRequest(Protocol):
    """What output processing reads of a request: an engine Request, or a serving process's record
    of one whose engine runs in a core process (services/engine/core_client.py)."""

    @property
    def request_id(self) -> str: ...
    @property
    def sampling_params(self) -> SamplingParams: ...
    @property
    def all_token_ids(self) -> list[int]: ...  # read before its first step only (prompt, a migrated stream's tokens)
    @property
    def num_prompt_tokens(self) -> int: ...
    @property
    def num_cached_tokens(self) -> int: ...  # fixed by its first token
    @property
    def first_scheduled_time(self) -> float | None: ...  # monotonic; fixed by its first token
    @property
    def handoff_times(self) -> HandoffTimes | None: ...  # a decode worker's handed-off request's


@dataclass(slots=True)
class StepTokens:
    """One step's result before output processing: one new token per request that advanced."""

    requests: Sequence[OutputRequest]  # the requests that got a token, in batch order
    token_ids: list[int]  # each one's new token
    finished: dict[str, Finish]  # the requests of this step that finished in the engine
    time: float  # monotonic: when the tokens were known (a request's first-token time)
    logprobs: LogprobsSource | None = None  # None: no request of this step asked for logprobs
    # stopped by an error: (request, message)
    failed: Sequence[tuple[OutputRequest, str]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.requests and not self.failed
