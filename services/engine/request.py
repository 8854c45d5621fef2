"""A request's state as the scheduler sees it.

Tokens, not phases: `num_computed_tokens` (tokens whose KV is in the cache) catches up with
`num_tokens` (prompt + sampled). Prefill, chunked prefill, a prefix hit, recompute after
preemption and (later) KV arriving from a prefill worker all just move `num_computed_tokens`.
A token is sampled whenever a step brings `num_computed_tokens` up to `num_tokens`.

Decode tier: a request whose KV comes from a prefill worker waits in AWAITING_KV holding reserved
blocks; when the blocks land, `num_computed_tokens` jumps to the prompt length and it joins the
waiting queue like any other request (see services/disagg/decode.py for the whole handoff).
"""

from __future__ import annotations

import enum
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NewType

from splitserve.common.block_hash import BlockHash, extend_block_hashes
from splitserve.common.sampling_params import SamplingParams

if TYPE_CHECKING:
    from splitserve.services.engine.kv_cache.block_pool import BlockId
    from splitserve.services.engine.layer_progress import LayerProgress

RequestId = NewType("RequestId", str)

_arrival_counter = itertools.count()


@dataclass(slots=True)
class HandoffTimes:
    """A decode worker's handed-off request's times (CLOCK_MONOTONIC seconds), each stamped on the
    step loop where it happened: the first token accepted (with the prefill worker's own two times),
    then the KV landed or the prompt was set to recompute, always before the request's first schedule.
    The output processor turns them into its stages (splitserve.v1.StageTimings) on the final output."""

    prefill_queue_ms: float
    prefill_compute_ms: float
    first_token_time: float
    landed_time: float | None = None
    landing_reported: bool = False  # an engine core's: its step tokens carried the landing (core_wire.py)

    def stages(self, scheduled: float | None, decoded: float | None) -> dict[str, float]:
        """scheduled: the request's first schedule here (after the landing); decoded: when that
        step's token was known."""
        stages = {"prefill_queue_ms": self.prefill_queue_ms, "prefill_compute_ms": self.prefill_compute_ms}
        if self.landed_time is None:
            return stages
        stages["kv_transfer_ms"] = (self.landed_time - self.first_token_time) * 1e3
        if scheduled is not None and decoded is not None:
            stages["decode_queue_ms"] = (scheduled - self.landed_time) * 1e3
            stages["first_decode_step_ms"] = (decoded - scheduled) * 1e3
        return stages


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    AWAITING_KV = "awaiting_kv"  # decode tier: blocks reserved, KV in flight from a prefill worker
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"  # EOS, a stop token or a stop string
    FINISHED_LENGTH = "finished_length"  # max_tokens or the model context
    FINISHED_ABORTED = "finished_aborted"

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED


_FINISHED = {RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED}


class FinishReason(enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


FINISH_REASON = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
}


class Request:
    def __init__(
        self,
        request_id: RequestId,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        max_tokens: int,
        eos_token_ids: frozenset[int],
        block_size: int,
        priority: int = 0,
        stop_after_prefill: bool = False,
        label: str = "",
    ) -> None:
        self.request_id = request_id  # the engine's own id, unique in this process's lifetime
        self.label = label  # the client's id: echoed in logs, never used as a key
        self.sampling_params = sampling_params
        # Greedy without penalties, logprobs or min_tokens: sampled by one argmax over the whole batch.
        self.plain_greedy = (
            sampling_params.greedy
            and not sampling_params.has_penalties
            and sampling_params.logprobs is None
            and sampling_params.min_tokens == 0
        )
        self.max_tokens = max_tokens  # resolved: never None
        self.eos_token_ids = eos_token_ids
        self._stop_eos = frozenset() if sampling_params.ignore_eos else eos_token_ids  # EOS ids that stop it
        # For the scheduler's quick test of whether a token may end the request (check_stop decides).
        self.stopping_ids = self._stop_eos | frozenset(sampling_params.stop_token_ids)
        self.max_num_tokens = len(prompt_token_ids) + max_tokens
        self.priority = priority
        # Prefill tier: finish once the first token is sampled; the KV stays as prefix cache.
        self.stop_after_prefill = stop_after_prefill
        # Prefill tier, streaming its KV as computed: told (on the step thread) the prompt's blocks and
        # the progress of the step computing its last prompt chunk, before that step's forward.
        self.kv_stream: Callable[[Sequence[BlockId], LayerProgress], None] | None = None
        self.arrival_time = time.monotonic()
        self.arrival_seq = next(_arrival_counter)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at first schedule
        self.num_preemptions = 0
        self.first_scheduled_time: float | None = None  # monotonic, set by the scheduler at first admission
        self.handoff_times: HandoffTimes | None = None  # a decode worker's: set when its first token came
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.block_size = block_size
        self.block_hashes: list[BlockHash] = []
        extend_block_hashes(self.block_hashes, self.all_token_ids, block_size)

    @property
    def num_prompt_blocks(self) -> int:
        """Blocks the prompt's KV fills (the last one maybe in part)."""
        return -(-self.num_prompt_tokens // self.block_size)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        # Identity tests: hashing an Enum member runs Python code, and this is read per request per step.
        status = self.status
        return (
            status is RequestStatus.FINISHED_STOPPED
            or status is RequestStatus.FINISHED_LENGTH
            or status is RequestStatus.FINISHED_ABORTED
        )

    @property
    def finish_reason(self) -> FinishReason | None:
        return FINISH_REASON.get(self.status)

    def append_output_token(self, token_id: int) -> None:
        tokens = self.all_token_ids
        tokens.append(token_id)
        if len(tokens) % self.block_size == 0:
            self.extend_block_hashes()

    def extend_block_hashes(self) -> None:
        """Hash the blocks that became full (called whenever the token count reaches a multiple of the block size)."""
        extend_block_hashes(self.block_hashes, self.all_token_ids, self.block_size)

    def check_stop(self, max_model_len: int) -> RequestStatus | None:
        """The finished status after the newest token, or None to keep going."""
        tokens = self.all_token_ids
        token, num_tokens = tokens[-1], len(tokens)
        num_output = num_tokens - self.num_prompt_tokens
        params = self.sampling_params
        if num_output >= params.min_tokens:
            if token in self._stop_eos:
                return RequestStatus.FINISHED_STOPPED
            if token in params.stop_token_ids:
                self.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if num_output >= self.max_tokens or num_tokens >= max_model_len or self.stop_after_prefill:
            return RequestStatus.FINISHED_LENGTH
        return None

    def __repr__(self) -> str:
        label = f" {self.label[:64]!r}" if self.label else ""
        return (
            f"Request({self.request_id}{label}, {self.status.value}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens})"
        )
