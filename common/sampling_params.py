"""Per-request sampling parameters, validated at construction."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

# Temperatures below this are greedy (as in vLLM): dividing logits by them overflows to inf/NaN.
GREEDY_TEMPERATURE = 1e-5


def _as_str_tuple(stop: object) -> tuple[str, ...]:
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,) if stop else ()
    if isinstance(stop, Sequence) and all(isinstance(s, str) for s in stop):
        return tuple(s for s in stop if s)
    raise ValueError(f"stop must be a string or a list of strings, got {type(stop).__name__}: {stop!r}")


def _as_int_tuple(ids: object) -> tuple[int, ...]:
    if ids is None:
        return ()
    if isinstance(ids, Sequence) and not isinstance(ids, str):
        if all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            return tuple(ids)
    raise ValueError(f"stop_token_ids must be a list of non-negative ints, got {ids!r}")


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """What to sample and when to stop. temperature < 1e-5 (0 included) means greedy.

    max_tokens None means "until the context is full". top_k None means no top-k cut.
    logprobs None returns no logprobs; N returns the sampled token's logprob and the top N.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = field(default=())
    stop_token_ids: tuple[int, ...] = field(default=())
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop", _as_str_tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", _as_int_tuple(self.stop_token_ids))
        floats = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
        }
        for name, value in floats.items():
            if not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value}")
        checks = [
            (self.temperature >= 0.0, f"temperature must be >= 0, got {self.temperature}"),
            (0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k is None or self.top_k >= 1, f"top_k must be >= 1 or None, got {self.top_k}"),
            (0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}"),
            (self.repetition_penalty > 0.0, f"repetition_penalty must be > 0, got {self.repetition_penalty}"),
            (-2.0 <= self.presence_penalty <= 2.0, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (
                -2.0 <= self.frequency_penalty <= 2.0,
                f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}",
            ),
            (self.max_tokens is None or self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}"),
            (self.min_tokens >= 0, f"min_tokens must be >= 0, got {self.min_tokens}"),
            (
                self.max_tokens is None or self.min_tokens <= self.max_tokens,
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
            ),
            (self.logprobs is None or 0 <= self.logprobs <= 20, f"logprobs must be in [0, 20], got {self.logprobs}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    def check_token_ids(self, vocab_size: int) -> None:
        """Stop token ids must be real tokens (an id past the vocabulary would index out of range)."""
        bad = [t for t in self.stop_token_ids if t >= vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids must be in [0, {vocab_size}); got {bad[:5]}")

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
