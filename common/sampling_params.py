"""Per-request sampling parameters, validated at construction."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

# Temperatures below this are greedy (as in vLLM): dividing logits by them overflows to inf/NaN.
GREEDY_TEMPERATURE = 1e-5


class OutOfRange(ValueError):
    """A sampling value outside its range. param: the field; code: what OpenAI's API calls the failure
    (decimal_below_min_value, integer_above_max_value, ...)."""

    def __init__(self, param: str, message: str, code: str) -> None:
        super().__init__(message)
        self.param, self.code = param, code


def _in_range(
    name: str,
    value: float,
    low: float | None = None,
    high: float | None = None,
    open_low: bool = False,
    message: str = "",
    integer: bool = False,
) -> None:
    """OutOfRange unless low <= value <= high (low < value with open_low); integer: an int field."""
    below = low is not None and (value <= low if open_low else value < low)
    above = high is not None and value > high
    if not (below or above):
        return
    kind = "integer" if integer else "decimal"
    if not message:
        message = f"{name} must be {_bounds(low, high, open_low)}"
    code = f"{kind}_below_min_value" if below else f"{kind}_above_max_value"
    raise OutOfRange(name, f"{message}, got {value}", code)


def _bounds(low: float | None, high: float | None, open_low: bool) -> str:
    if low is not None and high is not None:
        return f"in [{low:g}, {high:g}]"
    if low is not None:
        return f"{'>' if open_low else '>='} {low:g}"
    return f"<= {high:g}"


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
        _in_range("temperature", self.temperature, low=0.0)
        _in_range("top_p", self.top_p, low=0.0, high=1.0, open_low=True, message="top_p must be in (0, 1]")
        if self.top_k is not None:
            _in_range("top_k", self.top_k, low=1, message="top_k must be >= 1 or None", integer=True)
        _in_range("min_p", self.min_p, low=0.0, high=1.0)
        _in_range("repetition_penalty", self.repetition_penalty, low=0.0, open_low=True)
        _in_range("presence_penalty", self.presence_penalty, low=-2.0, high=2.0)
        _in_range("frequency_penalty", self.frequency_penalty, low=-2.0, high=2.0)
        if self.max_tokens is not None:
            _in_range("max_tokens", self.max_tokens, low=1, integer=True)
        _in_range("min_tokens", self.min_tokens, low=0, integer=True)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise OutOfRange(
                "min_tokens",
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
                "integer_above_max_value",
            )
        if self.logprobs is not None:
            _in_range("logprobs", self.logprobs, low=0, high=20, integer=True)

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
