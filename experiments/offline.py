"""What the in-process benchmarks share: the offline workload's settings (benchmarks/offline.py, and
benchmarks/serving.py sends the same requests through the gateway) and the cost of one decode step
at a given batch size (benchmarks/offline.py on CPU, benchmarks/attention_kernels.py per attention backend)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar
from unittest.mock import patch

from splitserve.common.sampling_params import SamplingParams
from splitserve.experiments.workload import LengthDist, WorkloadConfig, make_requests
from splitserve.services.engine.llm import LLM

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Settings:
    num_requests: int
    prompt_lens: tuple[int, int]  # inclusive range
    output_lens: tuple[int, int]
    decode_batches: tuple[int, ...]
    decode_context: int = 300
    decode_steps: int = 20
    seed: int = 0

    def workload(self, vocab_size: int) -> WorkloadConfig:
        """All requests at once (fixed concurrency = num_requests), lengths uniform in the ranges."""
        return WorkloadConfig(
            num_requests=self.num_requests,
            arrival="concurrency",
            concurrency=self.num_requests,
            prompt_len=LengthDist("uniform", *self.prompt_lens),
            output_len=LengthDist("uniform", *self.output_lens),
            seed=self.seed,
            vocab_high=vocab_size,
        )


FULL = Settings(64, (32, 512), (16, 256), (1, 8, 32, 64))
QUICK = Settings(8, (32, 128), (8, 32), (1, 8), decode_steps=5)


def decode_step_ms(llm: LLM, batch_size: int, context: int, num_steps: int) -> tuple[float, float]:
    """(ms per engine.step, ms per runner.forward within those steps) once batch_size requests of
    context-token prompts all decode; each a mean of num_steps after one warm-up. The requests are
    aborted after."""
    ids = start_decodes(llm, batch_size, context)
    step_s, forward_s = timed_steps(llm, num_steps)
    for request_id in ids:
        llm.engine.abort_request(request_id)
    return sum(step_s) * 1e3 / num_steps, sum(forward_s) * 1e3 / num_steps


def start_decodes(llm: LLM, batch_size: int, context: int) -> list[str]:
    """Add batch_size requests of context-token random prompts and step until all of them decode (plus
    one warm-up decode step); their request ids (abort them when done: they would run context tokens)."""
    engine = llm.engine
    prompts = make_requests(
        WorkloadConfig(
            num_requests=batch_size,
            prompt_len=LengthDist("fixed", context),
            seed=1000 + batch_size,
            vocab_high=engine.runner.arch.vocab_size,
        )
    )
    # Early requests decode while later ones still prefill (chunked): leave room so none finishes.
    params = SamplingParams(temperature=0, max_tokens=context, ignore_eos=True)
    ids = [engine.add_request(p.prompt_token_ids, params) for p in prompts]
    running = engine.scheduler.running
    while not (len(running) == batch_size and all(r.num_tokens - r.num_computed_tokens == 1 for r in running)):
        assert len(engine.scheduler.requests) == batch_size, "a decode-table request finished early"
        engine.step()
    engine.step()  # warm-up decode
    return ids


def timed_steps(llm: LLM, num_steps: int) -> tuple[list[float], list[float]]:
    """Seconds of each of num_steps engine.step() calls, and of the runner.forward inside each. The
    forward is timed inside real steps, not by replaying one batch: the CPU decode path keeps each
    sequence's K/V from step to step (attention/decode_mirror.py), and a replayed batch would look like
    sequences whose length did not grow (refilled every time)."""
    engine, step_s, forward_s = llm.engine, [], []
    runner_forward = engine.runner.forward

    def timed_forward(*args: Any, **kwargs: Any) -> Any:
        result, seconds = timed(runner_forward, *args, **kwargs)
        forward_s.append(seconds)
        return result

    with patch.object(engine.runner, "forward", timed_forward):  # restores a caller's wrapper (kernels.py)
        for _ in range(num_steps):
            step_s.append(timed(engine.step)[1])
    assert len(forward_s) == num_steps
    return step_s, forward_s


def timed(fn: Callable[..., T], *args: Any, **kwargs: Any) -> tuple[T, float]:
    """(fn(*args, **kwargs), wall seconds it took)."""
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    return result, time.perf_counter() - start
