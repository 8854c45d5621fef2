"""Host overhead of one decode step: everything the engine does around the model forward.

The tiny test Llama (vocab 320, written with transformers as tests/conftest.py does) with N running
decode requests (greedy, ignore_eos, long max_tokens; prompts of 4-19 tokens so that requests cross
block boundaries on different steps), one torch thread. The model forward is replaced by a stub of
zero cost that returns precomputed random logits of the right shape [num_sampling, vocab]; the rest
(scheduling, input preparation, sampling, bookkeeping, detokenization and output building) runs for
real. Every request decodes in every timed step.

Three ways of stepping, each timed per step (median and p90 over --steps, after --warm-up steps),
in wall time and in CPU time (time.thread_time for `step`: what the step itself costs, much less
disturbed than wall time by other processes on a shared machine):
- `step`: Engine.step(), outputs detokenized and built in the calling thread (what LLM does).
- `in_process`: the serving path with the engine core stepping on a thread of this process
  (EngineCoreClient.in_process: the same core and pipe as a worker's, no spawn), one consuming task
  per request (as the gRPC servicer has); wall time per step the core ran, from the first add to the
  last output (prefill step included); CPU time of the whole process (the core's thread and the
  serving side share its GIL).
- `core`: the same serving path with the engine core in a process of its own (EngineCoreClient, as
  a worker runs it): the consuming tasks here, the step loop and the stub
  there; wall time per step the core ran. --no-core skips it.

--baseline-pythonpath DIR runs the same measurement first in a subprocess importing `splitserve`
from DIR (e.g. a folder whose one link, `splitserve`, points at a `git worktree` of HEAD: docs/benchmarks.md),
so that both sides are measured in one session, and prints the ratios.

Usage: python benchmarks/step_overhead.py [--batches 32,256] [--steps 200] [--json runs/step_overhead.json]
       [--baseline-pythonpath /tmp/basepkg] [--profile 256]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import functools
import json
import os
import pstats
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from conftest import _save_tiny  # noqa: E402  (the tiny model the tests use)

import splitserve.services.engine  # noqa: E402
from splitserve.common.sampling_params import SamplingParams  # noqa: E402
from splitserve.experiments.cpu import cpu_seconds  # noqa: E402
from splitserve.services.engine.config import CacheConfig, EngineConfig, SchedulerConfig  # noqa: E402
from splitserve.services.engine.engine import Engine  # noqa: E402

MAX_MODEL_LEN = 512  # the tiny Llama's context
NUM_LOGIT_BANKS = 8  # the stub cycles through this many random logit tensors
SEED = 0


class StubForward:
    """Replaces ModelRunner.forward: returns precomputed logits [num_sampling, vocab] at no cost."""

    def __init__(self, max_batch: int, vocab: int, forward_ms: float = 0.0) -> None:
        gen = torch.Generator().manual_seed(SEED)
        self.forward_s = forward_ms / 1e3  # > 0: a forward that waits this long off the GIL, as a GPU's would
        self.banks = [torch.randn(max_batch, vocab, generator=gen).mul_(4.0) for _ in range(NUM_LOGIT_BANKS)]
        self.calls = 0

    def __call__(self, batch, layers=None) -> torch.Tensor:
        self.calls += 1
        if self.forward_s:
            time.sleep(self.forward_s)
        return self.banks[self.calls % NUM_LOGIT_BANKS][: len(batch.sample_rows)]


def engine_config(model: str, batch: int) -> EngineConfig:
    return EngineConfig(
        model=model,
        device="cpu",
        max_model_len=MAX_MODEL_LEN,
        seed=SEED,
        cache=CacheConfig(block_size=16, kv_cache_bytes=(batch + 1) * MAX_MODEL_LEN * 1024),
        scheduler=SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=max(2048, batch * 20)),
    )


def install_stub(batch: int, forward_ms: float, engine: Engine) -> None:
    """The forward becomes a StubForward, one torch thread (in this process or an engine core's)."""
    torch.set_num_threads(1)
    engine.runner.forward = StubForward(batch, engine.vocab_size, forward_ms)  # type: ignore[method-assign]


def make_engine(model: str, batch: int, forward_ms: float = 0.0) -> Engine:
    engine = Engine(engine_config(model, batch))
    install_stub(batch, forward_ms, engine)
    return engine


def make_prompts(vocab_size: int, batch: int) -> list[list[int]]:
    """batch prompts of 4-19 tokens (block boundaries fall on different steps), the same every run."""
    rng = random.Random(SEED)
    return [[rng.randrange(1, vocab_size) for _ in range(rng.randrange(4, 20))] for _ in range(batch)]


def add_requests(engine: Engine, batch: int, num_steps: int) -> None:
    for prompt in make_prompts(engine.vocab_size, batch):
        engine.add_request(prompt, SamplingParams(temperature=0, ignore_eos=True, max_tokens=num_steps + 8))


def percentiles(times_ms: list[float]) -> dict[str, float]:
    ordered = sorted(times_ms)
    return {
        "median_ms": round(statistics.median(ordered), 4),
        "p90_ms": round(ordered[int(0.9 * (len(ordered) - 1))], 4),
        "mean_ms": round(statistics.fmean(ordered), 4),
    }


def time_steps(engine: Engine, batch: int, steps: int, warm_up: int) -> dict[str, float]:
    """Engine.step() in this thread (wall and this thread's CPU time per step); checks that every
    request decodes in every timed step."""
    add_requests(engine, batch, steps + warm_up)
    for _ in range(warm_up):
        engine.step()
    wall, cpu = [], []
    for _ in range(steps):
        start, start_cpu = time.perf_counter(), time.thread_time()
        outputs = engine.step()
        cpu.append((time.thread_time() - start_cpu) * 1e3)
        wall.append((time.perf_counter() - start) * 1e3)
        if len(outputs) != batch:
            raise RuntimeError(f"a timed step produced {len(outputs)} outputs, expected {batch}")
    return percentiles(wall) | {f"cpu_{k}": v for k, v in percentiles(cpu).items()}


def time_in_process(engine: Engine, batch: int, steps: int) -> dict[str, float] | None:
    """The serving path with the engine core on a thread of this process (EngineCoreClient.in_process),
    one consuming task per request (as the gRPC servicer has), from the first add to the last output.
    ms per step = wall time / steps the core ran. None on a tree without an in-process core."""
    from splitserve.services.engine.core_client import EngineCoreClient

    if not hasattr(EngineCoreClient, "in_process"):
        return None
    prompts = make_prompts(engine.vocab_size, batch)
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=steps)

    async def run() -> tuple[float, tuple[int, float], dict[str, float]]:
        client = EngineCoreClient.in_process(engine)
        before = client.load().steps

        async def consume(prompt: list[int]) -> int:
            return sum([len(out.new_token_ids) async for out in client.generate(prompt, params)])

        start, cpu = time.perf_counter(), time.process_time()
        counts = await asyncio.gather(*(consume(p) for p in prompts))
        wall_ms, cpu_ms = (time.perf_counter() - start) * 1e3, (time.process_time() - cpu) * 1e3
        await client.shutdown()  # then load() is the core's final state
        if counts != [steps] * batch:
            raise RuntimeError("a stream lost tokens")
        return wall_ms, steps_between(before, client.load().steps), {"process_cpu_ms": cpu_ms}

    return per_step(*asyncio.run(run()))


def steps_between(before: dict, after: dict) -> tuple[int, float]:
    """Steps run and seconds inside them (schedule to update), from two step-stats snapshots."""
    num_steps = sum(after[k].num_steps - before[k].num_steps for k in after)
    return num_steps, sum(after[k].seconds - before[k].seconds for k in after)


def per_step(wall_ms: float, steps: tuple[int, float], cpu_ms: dict[str, float]) -> dict[str, float]:
    """ms per step of wall time, of time inside step(), between steps (the loop's commands, waits
    for the GIL or for the consumers), and of each process's CPU time."""
    num_steps, seconds = steps
    wall, inside = wall_ms / num_steps, seconds * 1e3 / num_steps
    return {
        "ms_per_step": round(wall, 4),
        "step_ms": round(inside, 4),
        "between_steps_ms": round(wall - inside, 4),
        "steps": num_steps,
        **{name: round(ms / num_steps, 4) for name, ms in cpu_ms.items()},
    }


def time_core(model: str, batch: int, steps: int, forward_ms: float) -> dict[str, float]:
    """The serving path with the engine core in its own process (EngineCoreClient, as a worker with
    runs it): one consuming task per request here, the step loop there. ms per
    step = wall time / steps the core ran (from its load reports)."""
    from splitserve.services.engine.core_client import EngineCoreClient

    client = EngineCoreClient.launch(
        engine_config(model, batch), prepare=functools.partial(install_stub, batch, forward_ms)
    )
    prompts = make_prompts(client.vocab_size, batch)
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=steps)

    async def run() -> tuple[float, int]:
        client.start()
        before = client.load().steps

        async def consume(prompt: list[int]) -> int:
            return sum([len(out.new_token_ids) async for out in client.generate(prompt, params)])

        start, cpu, core_cpu = time.perf_counter(), time.process_time(), cpu_seconds(client.pid)
        counts = await asyncio.gather(*(consume(p) for p in prompts))
        wall_ms = (time.perf_counter() - start) * 1e3
        cpu_ms = {
            "core_cpu_ms": (cpu_seconds(client.pid) - core_cpu) * 1e3,
            "serving_cpu_ms": (time.process_time() - cpu) * 1e3,
        }
        await client.shutdown()  # then load() is the core's final state
        if counts != [steps] * batch:
            raise RuntimeError("a stream lost tokens")
        return wall_ms, steps_between(before, client.load().steps), cpu_ms

    return per_step(*asyncio.run(run()))


def profile(model: str, batch: int, steps: int) -> None:
    engine = make_engine(model, batch)
    add_requests(engine, batch, steps + 5)
    for _ in range(5):
        engine.step()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        engine.step()
    prof.disable()
    print(f"cProfile of {steps} Engine.step() at batch {batch} (cumulative ms per step):")
    stats = pstats.Stats(prof)
    rows = []
    for (file, line, name), (_, _, _, cumtime, _) in stats.stats.items():  # type: ignore[attr-defined]
        rows.append((cumtime * 1e3 / steps, f"{Path(file).name}:{line}:{name}"))
    for ms, where in sorted(rows, reverse=True)[:40]:
        print(f"  {ms:8.3f}  {where}")


def measure(
    model: str, batches: list[int], steps: int, warm_up: int, core: bool = True, forward_ms: float = 0.0
) -> list[dict]:
    rows = []
    for batch in batches:
        row = {"batch": batch, "step": time_steps(make_engine(model, batch), batch, steps, warm_up)}
        in_process = time_in_process(make_engine(model, batch, forward_ms), batch, steps)
        if in_process is not None:
            row["in_process"] = in_process
        if core:
            row["core"] = time_core(model, batch, steps, forward_ms)
        rows.append(row)
    return rows


def run_baseline(pythonpath: str, args: argparse.Namespace, model: str) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "baseline.json"
        cmd = [sys.executable, __file__, "--batches", args.batches, "--steps", str(args.steps)]
        cmd += ["--warm-up", str(args.warm_up), "--model", model, "--json", str(path), "--no-core"]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [pythonpath, os.environ.get("PYTHONPATH")])))
        subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)  # its table is printed below
        return json.loads(path.read_text())


def print_table(title: str, rows: list[dict]) -> None:
    print(title)
    print(
        "| batch | step() wall median | step() CPU median | step() CPU p90 "
        "| in-process core wall (between steps; CPU) | core process wall (between steps; CPU core + serving) |"
    )
    print("|---|---|---|---|---|---|")
    for r in rows:
        s = r["step"]
        step = f"{s['median_ms']:.3f} | {s['cpu_median_ms']:.3f} | {s['cpu_p90_ms']:.3f}"
        serving = [_serving(r.get(k)) for k in ("in_process", "core")]
        print(f"| {r['batch']} | {step} | {serving[0]} | {serving[1]} |")


def _serving(m: dict | None) -> str:
    """wall (between steps; CPU per step: the process's, or the core's + the serving process's)"""
    if m is None:
        return "-"
    if "between_steps_ms" not in m:  # a baseline from before these columns
        return f"{m['ms_per_step']:.3f}"
    cpu = f"{m['core_cpu_ms']:.2f} + {m['serving_cpu_ms']:.2f}" if "core_cpu_ms" in m else f"{m['process_cpu_ms']:.2f}"
    return f"{m['ms_per_step']:.3f} ({m['between_steps_ms']:.3f}; CPU {cpu})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="32,256", help="running requests, comma-separated")
    parser.add_argument("--steps", type=int, default=200, help="timed steps per batch size")
    parser.add_argument("--warm-up", type=int, default=10)
    parser.add_argument("--model", help="a tiny checkpoint folder (default: written to a temp dir)")
    parser.add_argument("--baseline-pythonpath", help="also measure the splitserve found on this PYTHONPATH")
    parser.add_argument("--profile", type=int, metavar="BATCH", help="print a cProfile of Engine.step() instead")
    parser.add_argument(
        "--forward-ms",
        type=float,
        default=0.0,
        help="the serving paths' (in_process, core) stub forward sleeps this long, off the GIL as a GPU "
        "forward waits; step() keeps a zero-cost forward",
    )
    parser.add_argument("--no-core", action="store_true", help="skip the engine core process (older trees lack it)")
    parser.add_argument("--json", metavar="PATH", default="runs/step_overhead.json")
    args = parser.parse_args()
    if args.steps + args.warm_up + 8 + 19 > MAX_MODEL_LEN:  # prompts of up to 19 tokens must not reach the context
        parser.error(f"--steps + --warm-up must stay under {MAX_MODEL_LEN - 27} (the tiny model's context)")
    torch.set_num_threads(1)
    batches = [int(b) for b in args.batches.split(",")]
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(_save_tiny(Path(tmp), "llama"))
        if args.profile:
            profile(model, args.profile, args.steps)
            return
        baseline = run_baseline(args.baseline_pythonpath, args, model) if args.baseline_pythonpath else None
        rows = measure(model, batches, args.steps, args.warm_up, not args.no_core, args.forward_ms)
    source = str(Path(splitserve.services.engine.__file__).parent)
    if baseline:
        print_table(f"baseline ({baseline['settings']['engine_source']}), ms per decode step", baseline["results"])
    print_table(f"this tree ({source}), ms per decode step", rows)
    if baseline:
        for base, new in zip(baseline["results"], rows):
            base_ms = base["step"]["cpu_median_ms"]
            step_ratio = base_ms / new["step"]["cpu_median_ms"]
            print(f"batch {new['batch']}: CPU per step, baseline step() / step() {step_ratio:.1f}x")
    settings = {
        "engine_source": source,
        "steps": args.steps,
        "warm_up": args.warm_up,
        "torch_threads": 1,
        "serving_forward_ms": args.forward_ms,
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "load_average_1m_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
    }
    print(f"1-minute load average before / after: {settings['load_average_1m_before_after']}")
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"settings": settings, "results": rows, "baseline": baseline}, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
