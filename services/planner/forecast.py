"""Forecasts of the next intervals' load: Holt's linear exponential smoothing (a level and a trend)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Holt:
    """Level and trend of a series observed once per interval. alpha weighs the newest value against the
    level, beta the newest change against the trend; forecast(h) is the value h intervals ahead (>= 0:
    a rate or a length is never negative)."""

    alpha: float = 0.5
    beta: float = 0.3
    level: float | None = None
    trend: float = 0.0

    def __post_init__(self) -> None:
        if not (0 < self.alpha <= 1 and 0 <= self.beta <= 1):
            raise ValueError(f"need 0 < alpha <= 1 and 0 <= beta <= 1, got {self.alpha}, {self.beta}")

    def update(self, value: float) -> None:
        if self.level is None:
            self.level = value
            return
        previous = self.level
        self.level = self.alpha * value + (1 - self.alpha) * (previous + self.trend)
        self.trend = self.beta * (self.level - previous) + (1 - self.beta) * self.trend

    def forecast(self, intervals_ahead: float) -> float:
        if self.level is None:
            return 0.0
        return max(0.0, self.level + intervals_ahead * self.trend)


@dataclass(frozen=True, slots=True)
class Load:
    """What the tiers must serve: requests/s and mean lengths."""

    rate: float
    prompt_tokens: float
    output_tokens: float


class LoadForecaster:
    """Holt over the rate and the two mean lengths. A length is updated only in intervals that saw
    requests (an idle interval says nothing about the next request's length)."""

    def __init__(self, alpha: float = 0.5, beta: float = 0.3) -> None:
        self.rate = Holt(alpha, beta)
        self.prompt_tokens = Holt(alpha, beta)
        self.output_tokens = Holt(alpha, beta)

    def update(self, load: Load) -> None:
        self.rate.update(load.rate)
        if load.rate > 0:
            self.prompt_tokens.update(load.prompt_tokens)
            self.output_tokens.update(load.output_tokens)

    def forecast(self, intervals_ahead: float) -> Load:
        return Load(
            self.rate.forecast(intervals_ahead),
            self.prompt_tokens.forecast(intervals_ahead),
            self.output_tokens.forecast(intervals_ahead),
        )
