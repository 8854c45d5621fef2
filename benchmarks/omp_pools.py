"""What a second OpenMP pool costs the thread that computes (services/engine/cpu_threads.py).

Times a decode-sized linear ([32, 576] x [576, 1536], SmolLM2-135M's QKV projection at batch 32) on
the main thread, in four conditions, each run back to back in one process:
  alone           - no other thread has run a parallel torch op;
  pool alive      - another thread ran one parallel op and is still alive (idle, blocked on an event);
  serial alive    - the same, but that thread called serial_torch_ops() first (what KV transfer
                    threads do);
  after it ended  - the thread with the pool has ended.
Also the main thread's CPU time per wall second (2.0 = both cores of this VM busy).

Usage: python benchmarks/omp_pools.py [--calls 2000] [--rounds 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
from collections.abc import Callable

import torch

from splitserve.services.engine.cpu_threads import serial_torch_ops


def time_linear(calls: int) -> tuple[float, float]:
    """(µs per call, process CPU seconds per wall second) of the linear on the calling thread."""
    x, w = torch.randn(32, 576), torch.randn(1536, 576)
    for _ in range(50):
        torch.nn.functional.linear(x, w)
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(calls):
        torch.nn.functional.linear(x, w)
    wall = time.perf_counter() - wall
    return wall / calls * 1e6, (time.process_time() - cpu) / wall


def with_idle_thread(setup: Callable[[], None], calls: int) -> tuple[float, float]:
    """time_linear while another thread, after setup() and one parallel op, waits."""
    ready, release = threading.Event(), threading.Event()

    def idle() -> None:
        setup()
        torch.ones(1 << 22).add_(1)  # parallel: far above torch's grain
        ready.set()
        release.wait()

    thread = threading.Thread(target=idle)
    thread.start()
    ready.wait()
    try:
        return time_linear(calls)
    finally:
        release.set()
        thread.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    conditions: dict[str, Callable[[], tuple[float, float]]] = {
        "alone": lambda: time_linear(args.calls),
        "pool alive": lambda: with_idle_thread(lambda: None, args.calls),
        "serial alive": lambda: with_idle_thread(serial_torch_ops, args.calls),
        "after it ended": lambda: time_linear(args.calls),
    }
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in conditions}
    for _ in range(args.rounds):
        for name, run in conditions.items():
            samples[name].append(run())
    print(f"linear [32, 576] x [576, 1536], {args.calls} calls, torch threads {torch.get_num_threads()}")
    print(f"{'main thread, another thread':<30}{'µs per call':>12}{'CPU / wall':>12}")
    results = {}
    for name, runs in samples.items():
        us, busy = statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)
        results[name] = {"us_per_call": us, "cpu_per_wall": busy, "samples": runs}
        print(f"{name:<30}{us:>12.1f}{busy:>12.2f}")
    if args.json:
        conditions_info = {"torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count()}
        conditions_info["load"] = os.getloadavg()
        with open(args.json, "w") as f:
            json.dump({"conditions": conditions_info, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
