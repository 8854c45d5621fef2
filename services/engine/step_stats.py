"""What the engine's steps cost, summed per kind of step: the data the planner refits its performance
model on (services/planner/profile.py), exported by the worker (services/worker/metrics.py, `splitserve_engine_step_*`).

Per step, from the step's inputs (starts: each sequence's tokens already in KV; query_lens: its tokens
this step) and its wall time from schedule to update:
  num_seqs, num_tokens (sum of query_lens), context_tokens (sum of starts + query_lens: the KV of every
  sequence after the step), and for prefill steps attention_tokens2 (sum of (start + query_len)^2 -
  start^2). These are the sums the profile's features are made of: a decode step's features are
  (1, num_seqs, context_tokens), a prefill step's (1, num_tokens, attention_tokens2); the counters'
  deltas over an interval divided by its number of steps are the interval's mean step.

Torch-free (the planner imports StepKind). The step thread is the only writer; the metrics collector
reads a snapshot racily (a scrape may see one step half counted), as it reads the other stats.
"""

from __future__ import annotations

import bisect
import enum
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from splitserve.common.serving import LATENCY_BUCKETS

if TYPE_CHECKING:
    import numpy as np

STEP_SECONDS_BUCKETS = LATENCY_BUCKETS  # upper bounds of the step duration histogram (+Inf after them)


class StepKind(enum.Enum):
    """The values are the `kind` label of the step metrics."""

    PREFILL = "prefill"  # some sequence computes more than one token (a prompt, or a chunk of one)
    DECODE = "decode"  # every sequence computes one token: a decode batch


@dataclass(slots=True)
class StepTotals:
    """Cumulative sums over the steps of one kind."""

    num_steps: int = 0
    seconds: float = 0.0  # wall time, schedule to update
    num_seqs: int = 0
    num_tokens: int = 0
    context_tokens: int = 0  # tokens in KV after the step, over its sequences
    attention_tokens2: int = 0  # prefill: seq_len^2 - start^2 over its sequences (decode steps: 0)
    # steps by duration: [i] those <= STEP_SECONDS_BUCKETS[i] and above the bound before; [-1] the rest
    bucket_counts: list[int] = field(default_factory=lambda: [0] * (len(STEP_SECONDS_BUCKETS) + 1))

    def copy(self) -> StepTotals:
        return replace(self, bucket_counts=self.bucket_counts.copy())


class StepStats:
    """The engine's step totals, one StepTotals per kind."""

    def __init__(self) -> None:
        # Attributes, not a dict by kind: hashing an Enum member runs Python code, and this is per step.
        self.prefill, self.decode = StepTotals(), StepTotals()

    def record(self, starts: np.ndarray, query_lens: np.ndarray, num_tokens: int, seconds: float) -> None:
        """One step. starts, query_lens: [num_seqs] int64 (the step's StepArrays); num_tokens: their sum."""
        num_seqs = len(query_lens)
        if num_tokens == num_seqs:  # the hot path: one numpy sum and a few adds
            totals = self.decode
            context = int(starts.sum()) + num_tokens
        else:
            totals = self.prefill
            ends = starts + query_lens
            context = int(ends.sum())
            totals.attention_tokens2 += int((ends * ends - starts * starts).sum())
        totals.num_steps += 1
        totals.seconds += seconds
        totals.num_seqs += num_seqs
        totals.num_tokens += num_tokens
        totals.context_tokens += context
        totals.bucket_counts[bisect.bisect_left(STEP_SECONDS_BUCKETS, seconds)] += 1

    def snapshot(self) -> dict[StepKind, StepTotals]:
        return {StepKind.PREFILL: self.prefill.copy(), StepKind.DECODE: self.decode.copy()}
