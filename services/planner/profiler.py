"""`splitserve profile`: time a worker's forwards at a grid of shapes into a performance profile.

An in-process Engine with the worker's engine settings (model, dtype, device, token budget, batch limit,
KV cache) runs each shape on its own KV cache (ModelRunner.shape_forward): prefill steps of k prompts of
L tokens (k = 1, and as many as the token budget holds), the last chunk of a prompt longer than the
budget, and decode steps of B sequences at context C. A point is the median of `repeats` timed forwards
after an untimed one. The forward is what is timed: the engine's host work around a step (scheduling,
sampling, outputs; benchmarks/step_overhead.py) is left to the online refit, which sees whole steps.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from splitserve.services.engine.engine import Engine
from splitserve.services.engine.model_runner import StepShape
from splitserve.services.planner.profile import Point, Profile, WorkerLimits, decode_features, fit, prefill_features

log = logging.getLogger("splitserve.services.planner")


@dataclass(frozen=True, slots=True)
class ProfileGrid:
    prefill_lens: tuple[int, ...] = (128, 512, 2048, 8192)  # prompt tokens (over the budget: its last chunk)
    decode_batches: tuple[int, ...] = (1, 8, 32, 64, 128)
    decode_contexts: tuple[int, ...] = (256, 1024, 4096)
    repeats: int = 5

    def __post_init__(self) -> None:
        if self.repeats < 1 or not (self.prefill_lens and self.decode_batches and self.decode_contexts):
            raise ValueError("a profile grid needs prompt lengths, decode batches and contexts, and repeats >= 1")
        if min(self.prefill_lens + self.decode_batches + self.decode_contexts) < 1:
            raise ValueError(f"grid values must be >= 1: {self}")


def prefill_shapes(grid: ProfileGrid, limits: WorkerLimits, max_model_len: int) -> Iterator[StepShape]:
    budget = limits.max_num_batched_tokens
    for length in (n for n in grid.prefill_lens if n <= max_model_len):
        if length > budget:  # chunked: the last chunk attends to the whole prompt
            yield StepShape((length,), (budget,))
            continue
        for k in sorted({1, min(limits.max_num_seqs, budget // length)}):
            yield StepShape((length,) * k, (length,) * k)


def decode_shapes(grid: ProfileGrid, limits: WorkerLimits, max_model_len: int) -> Iterator[StepShape]:
    for batch in (b for b in grid.decode_batches if b <= limits.max_num_seqs):
        for context in (c for c in grid.decode_contexts if c <= max_model_len):
            yield StepShape((context,) * batch, (1,) * batch)


def measure_profile(engine: Engine, grid: ProfileGrid) -> Profile:
    """Times every grid shape that fits the engine's limits and KV cache; fits the two models."""
    sched = engine.config.scheduler
    limits = WorkerLimits(sched.max_num_batched_tokens, sched.max_num_seqs, engine.runtime.kv_capacity_tokens)
    max_model_len = engine.runtime.max_model_len
    prefill = _points(engine, prefill_shapes(grid, limits, max_model_len), grid.repeats, _prefill_x)
    decode = _points(engine, decode_shapes(grid, limits, max_model_len), grid.repeats, _decode_x)
    if not prefill or not decode:
        raise ValueError(
            f"no {'prefill' if not prefill else 'decode'} shape of the grid fits this engine (max_model_len "
            f"{max_model_len}, {limits}): choose smaller lengths, batches or contexts"
        )
    runner = engine.runner
    meta = {
        "model": str(engine.config.model or "bundled SmolLM2-135M-Instruct"),
        "device": str(runner.device),
        "dtype": str(runner.dtype).removeprefix("torch."),
        "torch": torch.__version__,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    return Profile(fit(prefill), fit(decode), limits, tuple(prefill), tuple(decode), meta)


def _prefill_x(shape: StepShape) -> tuple[float, ...]:
    return prefill_features(shape.query_lens, shape.seq_lens)


def _decode_x(shape: StepShape) -> tuple[float, ...]:
    return decode_features(len(shape.seq_lens), shape.seq_lens[0])


def _points(
    engine: Engine, shapes: Iterator[StepShape], repeats: int, features: Callable[[StepShape], tuple[float, ...]]
) -> list[Point]:
    points = []
    for shape in shapes:
        try:
            run = engine.runner.shape_forward(shape)
        except ValueError as e:  # its blocks do not fit this cache: a worker could not run it either
            log.info("skipped %d sequences of %d tokens: %s", len(shape.seq_lens), shape.seq_lens[0], e)
            continue
        points.append(Point(features(shape), _median_seconds(run, engine.runner.device, repeats)))
    return points


def _median_seconds(run: Callable[[], None], device: torch.device, repeats: int) -> float:
    def synchronize() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    run()  # untimed: first-call allocations and, on CUDA, kernel compilation
    synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
