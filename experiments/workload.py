"""What to send and when: prompt/output length distributions (or a replayed trace: JSONL, Azure LLM
inference or BurstGPT; see traces.py), shared prefixes, and arrivals (Poisson at a rate, bursts, a fixed
concurrency, or the trace's own timestamps, scaled). Deterministic per seed."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, field

from splitserve.experiments.traces import TraceConfig, arrival_times, load_trace, scale_gaps, scale_to_rate

_KINDS = ("fixed", "uniform", "normal")
_ARRIVALS = ("poisson", "burst", "concurrency", "trace")
_PREFIX_ASSIGNMENTS = ("random", "balanced")


@dataclass(frozen=True, slots=True)
class LengthDist:
    """fixed: a; uniform: integers in [a, b]; normal: mean a, stddev b (clipped to >= 1)."""

    kind: str = "fixed"
    a: float = 128
    b: float = 0

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"length distribution must be one of {_KINDS}, got {self.kind!r}")
        if self.a < 1 or (self.kind == "uniform" and self.b < self.a):
            raise ValueError(f"bad {self.kind} length distribution ({self.a}, {self.b})")

    @classmethod
    def parse(cls, text: str) -> LengthDist:
        """'128', 'uniform:32:512' or 'normal:256:64'."""
        parts = text.split(":")
        if len(parts) == 1:
            return cls("fixed", float(parts[0]))
        if len(parts) != 3:
            raise ValueError(f"length must be N, uniform:LO:HI or normal:MEAN:STD; got {text!r}")
        return cls(parts[0], float(parts[1]), float(parts[2]))

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return int(self.a)
        if self.kind == "uniform":
            return rng.randint(int(self.a), int(self.b))
        return max(1, round(rng.gauss(self.a, self.b)))


@dataclass(frozen=True, slots=True)
class WorkloadConfig:
    num_requests: int = 32
    duration_s: float | None = None  # with poisson/burst: stop sending after this long instead
    arrival: str = "poisson"  # or "trace": send at the trace's timestamps (time_scale, trace_at_rate)
    rate: float = 4.0  # requests / s (poisson, or a trace's mean with trace_at_rate), or bursts / s (burst)
    burst_size: int = 8
    concurrency: int = 4  # arrival "concurrency": this many in flight at all times
    prompt_len: LengthDist = field(default_factory=lambda: LengthDist("fixed", 128))
    output_len: LengthDist = field(default_factory=lambda: LengthDist("fixed", 32))
    # A trace file: prompt and output lengths come from its rows (all of them: num_requests is unused).
    trace: str | None = None
    trace_format: str = "auto"  # jsonl | azure | burstgpt | auto (from the first line); see traces.py
    trace_model: str | None = None  # burstgpt: only rows of this Model, e.g. "GPT-4"
    trace_log_type: str | None = None  # burstgpt: only rows of this Log Type, e.g. "Conversation log"
    trace_keep_failed: bool = False  # keep rows with 0 output tokens (failures), asking for 1 token
    trace_start_s: float = 0.0  # the window, in the trace's own seconds from its first row
    trace_duration_s: float | None = None
    trace_max_rows: int | None = None
    time_scale: float = 1.0  # arrival "trace": every gap between sends times this (0.5: twice the rate)
    trace_at_rate: bool = False  # arrival "trace": scale the gaps to a mean rate of `rate` instead (rate sweeps)
    # Clip every request to these lengths (traces hold prompts of thousands of tokens; small models take fewer).
    max_prompt_len: int | None = None
    max_output_len: int | None = None
    shared_prefix_fraction: float = 0.0  # share of requests that start with one of num_prefixes prefixes
    prefix_len: int = 0
    num_prefixes: int = 1
    prefix_assignment: str = "random"  # or "balanced": equal shares of the shared requests, in random order
    seed: int = 0
    vocab_low: int = 20  # token ids drawn from [vocab_low, vocab_high) (skips special tokens)
    vocab_high: int = 49152

    def __post_init__(self) -> None:
        if self.arrival not in _ARRIVALS:
            raise ValueError(f"arrival must be one of {_ARRIVALS}, got {self.arrival!r}")
        if self.prefix_assignment not in _PREFIX_ASSIGNMENTS:
            raise ValueError(f"prefix_assignment must be one of {_PREFIX_ASSIGNMENTS}, got {self.prefix_assignment!r}")
        if self.num_requests < 1 or self.rate <= 0 or self.concurrency < 1 or self.burst_size < 1:
            raise ValueError("num_requests, rate, concurrency and burst_size must be positive")
        if not 0.0 <= self.shared_prefix_fraction <= 1.0:
            raise ValueError("shared_prefix_fraction must be in [0, 1]")
        self._check_trace_settings()

    def _check_trace_settings(self) -> None:
        if self.arrival == "trace" and self.trace is None:
            raise ValueError("arrival 'trace' sends at a trace's timestamps: set trace to the file")
        if self.time_scale <= 0:
            raise ValueError(f"time_scale must be positive, got {self.time_scale}")
        if self.trace_at_rate and self.time_scale != 1.0:
            raise ValueError("give time_scale or trace_at_rate, not both: each sets the replay's speed")
        if any(n is not None and n < 1 for n in (self.max_prompt_len, self.max_output_len)):
            raise ValueError("max_prompt_len and max_output_len must be at least 1")
        self.trace_config()  # a bad format or window fails here, not when the run starts sending

    def trace_config(self) -> TraceConfig | None:
        """What traces.py needs to read this workload's trace; None without one."""
        if self.trace is None:
            return None
        return TraceConfig(
            self.trace,
            format=self.trace_format,
            model=self.trace_model,
            log_type=self.trace_log_type,
            keep_failed=self.trace_keep_failed,
            start_s=self.trace_start_s,
            duration_s=self.trace_duration_s,
            max_rows=self.trace_max_rows,
        )


@dataclass(frozen=True, slots=True)
class RequestSpec:
    prompt_token_ids: list[int]
    max_tokens: int
    prefix_id: int | None = None


def make_requests(cfg: WorkloadConfig) -> list[RequestSpec]:
    rng = random.Random(cfg.seed)
    trace = cfg.trace_config()
    rows = _trace_rows(trace) if trace else _sampled_rows(cfg, rng)
    prefixes: dict[int, list[int]] = {}
    specs = []
    for prompt_len, output_len, prefix_id in rows:
        prompt_len, output_len = _clip(prompt_len, cfg.max_prompt_len), _clip(output_len, cfg.max_output_len)
        prefix: list[int] = []
        if prefix_id is not None:
            length = cfg.prefix_len or prompt_len // 2
            prefix = prefixes.setdefault(prefix_id, _tokens(rng, length, cfg))
        body = _tokens(rng, max(1, prompt_len - len(prefix)), cfg)
        specs.append(RequestSpec(prefix + body, output_len, prefix_id))
    return specs


def _sampled_rows(cfg: WorkloadConfig, rng: random.Random) -> list[tuple[int, int, int | None]]:
    dealt = _balanced_prefix_ids(cfg, rng) if cfg.prefix_assignment == "balanced" else None
    rows = []
    for _ in range(cfg.num_requests):
        shared = cfg.shared_prefix_fraction and rng.random() < cfg.shared_prefix_fraction
        prefix_id = None
        if shared:
            prefix_id = next(dealt) if dealt is not None else rng.randrange(cfg.num_prefixes)
        rows.append((cfg.prompt_len.sample(rng), cfg.output_len.sample(rng), prefix_id))
    return rows


def _balanced_prefix_ids(cfg: WorkloadConfig, rng: random.Random) -> Iterator[int]:
    """Prefix ids dealt in equal shares (a shuffled deck), so no prefix gets more requests by chance."""
    deck = [i % cfg.num_prefixes for i in range(cfg.num_requests)]
    rng.shuffle(deck)
    return iter(deck)


def _trace_rows(trace: TraceConfig) -> list[tuple[int, int, int | None]]:
    return [(e.prompt_len, e.output_len, e.prefix_id) for e in load_trace(trace)]


def _clip(length: int, most: int | None) -> int:
    return length if most is None else min(length, most)


def _tokens(rng: random.Random, n: int, cfg: WorkloadConfig) -> list[int]:
    return [rng.randrange(cfg.vocab_low, cfg.vocab_high) for _ in range(n)]


def arrival_offsets(cfg: WorkloadConfig, num: int) -> list[float] | None:
    """Send time of each request in seconds from the start; None for fixed concurrency."""
    if cfg.arrival == "concurrency":
        return None
    if cfg.arrival == "trace":
        return _trace_offsets(cfg)[:num]
    rng = random.Random(cfg.seed + 1)
    if cfg.arrival == "poisson":
        t, out = 0.0, []
        for _ in range(num):
            out.append(t)
            t += rng.expovariate(cfg.rate)
        return out
    return [(i // cfg.burst_size) / cfg.rate for i in range(num)]


def _trace_offsets(cfg: WorkloadConfig) -> list[float]:
    """The trace's arrivals with their gaps scaled: by time_scale, or to a mean of `rate` requests/s."""
    trace = cfg.trace_config()
    assert trace is not None  # __post_init__: arrival "trace" needs a trace
    offsets = arrival_times(load_trace(trace), trace.path)
    return scale_to_rate(offsets, cfg.rate) if cfg.trace_at_rate else scale_gaps(offsets, cfg.time_scale)
