"""The performance model of one worker: step seconds as two small regressions, in a versioned JSON file.

  prefill step seconds = a + b * num_tokens + c * attention_tokens2
  decode step seconds  = a + b * batch + c * context_tokens

num_tokens: the step's prompt tokens; attention_tokens2: the sum over its sequences of
seq_len^2 - start^2 (a prompt run whole adds its length squared, and the chunks of one prompt add up to
the same): the quadratic attention term. batch: sequences decoding; context_tokens: their contexts
summed (the KV a step reads). Every coefficient is a cost, so the fit is non-negative least squares on
relative error (a 2 ms point weighs as much as a 2 s one).

`splitserve profile` (profiler.py) measures the points on a worker's hardware; the planner refits them
online (OnlineFit: the profile's points as a prior and a sliding window of points observed while serving).
"""

from __future__ import annotations

import json
import math
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

PROFILE_VERSION = 1
PREFILL_FEATURES = ("1", "num_tokens", "attention_tokens2")
DECODE_FEATURES = ("1", "batch", "context_tokens")
_MIN_OBSERVED_WITHOUT_PRIOR = 8  # points before a fit without prior points replaces the prior model


def prefill_features(query_lens: Sequence[float], seq_lens: Sequence[float] | None = None) -> tuple[float, ...]:
    """A prefill step's features; seq_lens None: every sequence is a whole prompt (seq_len = query_len)."""
    seq_lens = query_lens if seq_lens is None else seq_lens
    quadratic = sum(s * s - (s - q) * (s - q) for q, s in zip(query_lens, seq_lens))
    return prefill_step_features(sum(query_lens), quadratic)


def prefill_step_features(num_tokens: float, attention_tokens2: float) -> tuple[float, ...]:
    """A prefill step's features from its sums (what a worker counts per step: services/engine/step_stats.py)."""
    return (1.0, float(num_tokens), float(attention_tokens2))


def decode_features(batch: float, context: float) -> tuple[float, ...]:
    """A decode step's features; context: mean tokens per sequence."""
    return (1.0, float(batch), float(batch * context))


@dataclass(frozen=True, slots=True)
class Point:
    """One measured (or observed) step."""

    features: tuple[float, ...]
    seconds: float


@dataclass(frozen=True, slots=True)
class LinearModel:
    """seconds = coef . features, every coefficient >= 0."""

    coef: tuple[float, ...]

    def __post_init__(self) -> None:
        if any(not (c >= 0 and math.isfinite(c)) for c in self.coef):
            raise ValueError(f"coefficients must be finite and >= 0, got {self.coef}")

    def predict(self, features: Sequence[float]) -> float:
        return sum(c * x for c, x in zip(self.coef, features))


def fit(points: Sequence[Point], weights: Sequence[float] | None = None) -> LinearModel:
    """Non-negative least squares on relative error (each row divided by its seconds)."""
    kept = [(p, w) for p, w in zip(points, weights or [1.0] * len(points)) if p.seconds > 0 and w > 0]
    if not kept:
        raise ValueError("no points with seconds > 0 to fit")
    scale = np.array([w / p.seconds for p, w in kept])
    x = np.array([p.features for p, _ in kept], dtype=np.float64) * scale[:, None]
    y = np.array([p.seconds for p, _ in kept]) * scale
    return LinearModel(tuple(float(c) for c in _nonneg_lstsq(x, y)))


def _nonneg_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Exact NNLS for a few columns: the optimum is the unconstrained fit on some subset of columns
    with all its coefficients >= 0, so try every subset and keep the best feasible one."""
    num_cols = x.shape[1]
    col_scale = np.maximum(np.abs(x).max(axis=0), 1e-30)  # columns span 1 .. 1e7: condition the solve
    xs = x / col_scale
    best, best_err = np.zeros(num_cols), float(np.sum(y * y))
    for mask in range(1, 2**num_cols):
        cols = [i for i in range(num_cols) if mask >> i & 1]
        sol, *_ = np.linalg.lstsq(xs[:, cols], y, rcond=None)
        if (sol < 0).any():
            continue
        err = float(np.sum((xs[:, cols] @ sol - y) ** 2))
        if err < best_err:
            best, best_err = np.zeros(num_cols), err
            best[cols] = sol
    return best / col_scale


@dataclass(frozen=True, slots=True)
class WorkerLimits:
    """The engine settings the profile was measured with: what one worker's steps can hold."""

    max_num_batched_tokens: int
    max_num_seqs: int
    kv_capacity_tokens: int | None = None  # None: unknown (the decode batch is bounded by the others only)

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError(f"limits must be >= 1, got {self}")


@dataclass(frozen=True, slots=True)
class Profile:
    """One worker's performance model (a tensor-parallel worker counts as one: profile it whole)."""

    prefill: LinearModel
    decode: LinearModel
    limits: WorkerLimits
    prefill_points: tuple[Point, ...] = ()
    decode_points: tuple[Point, ...] = ()
    meta: Mapping[str, str] = field(default_factory=dict)  # model, device, dtype, when: for people

    def prefill_step_s(self, query_lens: Sequence[float], seq_lens: Sequence[float] | None = None) -> float:
        return self.prefill.predict(prefill_features(query_lens, seq_lens))

    def prefill_request_s(self, prompt_tokens: float) -> float:
        """One prompt alone, in chunks of the token budget: each chunk a step (a per step, the rest adds up)."""
        num_chunks = max(1, math.ceil(prompt_tokens / self.limits.max_num_batched_tokens))
        a, b, c = self.prefill.coef
        return num_chunks * a + b * prompt_tokens + c * prompt_tokens * prompt_tokens

    def prefill_rate(self, prompt_tokens: float) -> float:
        """Requests/s one prefill worker sustains when every step is full of prompts of this length."""
        per_step = min(self.limits.max_num_seqs, int(self.limits.max_num_batched_tokens // max(prompt_tokens, 1)))
        if per_step <= 1:
            return 1.0 / self.prefill_request_s(prompt_tokens)
        return per_step / self.prefill_step_s([prompt_tokens] * per_step)

    def decode_step_s(self, batch: float, context: float) -> float:
        return self.decode.predict(decode_features(batch, context))

    def refitted(self, prefill: LinearModel, decode: LinearModel) -> Profile:
        return replace(self, prefill=prefill, decode=decode)

    def to_json(self) -> dict:
        return {
            "version": PROFILE_VERSION,
            "meta": dict(self.meta),
            "limits": {
                "max_num_batched_tokens": self.limits.max_num_batched_tokens,
                "max_num_seqs": self.limits.max_num_seqs,
                "kv_capacity_tokens": self.limits.kv_capacity_tokens,
            },
            "prefill": _model_json(PREFILL_FEATURES, self.prefill, self.prefill_points),
            "decode": _model_json(DECODE_FEATURES, self.decode, self.decode_points),
        }

    @classmethod
    def from_json(cls, data: Mapping) -> Profile:
        version = data.get("version")
        if version != PROFILE_VERSION:
            raise ValueError(
                f"performance profile version {version!r}, this splitserve reads version {PROFILE_VERSION}: "
                "measure it again with `splitserve profile`"
            )
        prefill, prefill_points = _model_from_json(data["prefill"], PREFILL_FEATURES)
        decode, decode_points = _model_from_json(data["decode"], DECODE_FEATURES)
        return cls(prefill, decode, WorkerLimits(**data["limits"]), prefill_points, decode_points, data["meta"])

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        return cls.from_json(json.loads(Path(path).read_text()))


def _model_json(names: tuple[str, ...], model: LinearModel, points: Sequence[Point]) -> dict:
    return {
        "seconds": " + ".join(f"{name}*{c:.6g}" for name, c in zip(names, model.coef)),  # for people
        "features": list(names),
        "coef": list(model.coef),
        "points": [[*p.features, p.seconds] for p in points],  # each row: the features, then seconds
    }


def _model_from_json(data: Mapping, names: tuple[str, ...]) -> tuple[LinearModel, tuple[Point, ...]]:
    if tuple(data["features"]) != names:
        raise ValueError(f"profile features {data['features']}, expected {list(names)}")
    points = tuple(Point(tuple(row[:-1]), row[-1]) for row in data["points"])
    return LinearModel(tuple(float(c) for c in data["coef"])), points


class OnlineFit:
    """A LinearModel refitted as observed points arrive: the prior's points weigh prior_weight each,
    the latest `window` observed points 1 each. Without prior points the prior model stands until
    enough points are observed to fit all coefficients."""

    def __init__(
        self, prior: LinearModel, prior_points: Sequence[Point] = (), window: int = 256, prior_weight: float = 1.0
    ) -> None:
        self.prior, self.prior_points, self.prior_weight = prior, tuple(prior_points), prior_weight
        self.observed: deque[Point] = deque(maxlen=window)
        self.model = prior

    def add(self, points: Iterable[Point]) -> None:
        before = len(self.observed)
        self.observed.extend(p for p in points if p.seconds > 0)
        if len(self.observed) == before:
            return
        if not self.prior_points and len(self.observed) < _MIN_OBSERVED_WITHOUT_PRIOR:
            return
        points_all = [*self.prior_points, *self.observed]
        weights = [self.prior_weight] * len(self.prior_points) + [1.0] * len(self.observed)
        self.model = fit(points_all, weights)


class RefinedProfile:
    """A Profile whose two models follow what the workers are observed to do."""

    def __init__(self, profile: Profile, window: int = 256) -> None:
        self.base = profile
        self.prefill = OnlineFit(profile.prefill, profile.prefill_points, window)
        self.decode = OnlineFit(profile.decode, profile.decode_points, window)

    def add(self, prefill_points: Iterable[Point], decode_points: Iterable[Point]) -> None:
        self.prefill.add(prefill_points)
        self.decode.add(decode_points)

    def current(self) -> Profile:
        return self.base.refitted(self.prefill.model, self.decode.model)
