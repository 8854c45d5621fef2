"""Which threads of a process may run torch's CPU ops in parallel: one, the engine's step thread.

torch runs a CPU op in parallel through OpenMP (libgomp): the first parallel op a thread runs gives
that thread a pool of worker threads, kept for as long as the thread lives, busy or not. Once a
process has more pool threads than cores, libgomp makes every pool sleep almost at once after each
parallel region (its "throttled" spin), so each region of the next op pays a futex wake. A decode
forward is ~1,000 small ops: on the 2-core VM a [32, 576] x [576, 1536] linear took 1.71 ms instead
of 0.80 ms while an idle thread that had once run a parallel op was alive (benchmarks/omp_pools.py),
and a worker's decode steps took 1.6x as long as the same steps in process (docs/benchmarks.md,
"Through the gateway").

So:
- a worker loads and warms up its model on a thread that ends before the step thread starts
  (`on_passing_thread`): the step thread is then the only thread with a pool;
- threads that copy KV blocks beside the steps (the transfer executors, a rank's transfer loop) run
  their torch ops serially (`serial_torch_ops`, once per thread): the copies are bound by memory,
  not by cores, and the cores belong to the forward.
TP follower processes run their steps on their main thread, which is then the only one in theirs.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from typing import TypeVar

import torch

T = TypeVar("T")
log = logging.getLogger("splitserve.services.engine")


def serial_torch_ops() -> None:
    """From now on the calling thread runs torch's CPU ops on itself alone, never starting an OpenMP
    pool (a no-op where torch's OpenMP runtime is not libgomp or cannot be found)."""
    set_threads = _omp_set_num_threads()
    if set_threads is None:
        return
    # torch sets a thread's OpenMP thread count on its first use of the thread (a thread-local init),
    # which would undo the call below if it came later: make it happen first.
    torch.get_num_threads()
    set_threads(1)


@cache
def _omp_set_num_threads() -> Callable[[int], None] | None:
    """libgomp's omp_set_num_threads from the copy torch loaded (its own wheel's, not the system's):
    OpenMP's thread count is per thread, and torch offers no per-thread setter."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libgomp" in line.rsplit("/", 1)[-1]}
    except OSError:
        paths = set()
    if len(paths) != 1:
        log.debug("serial_torch_ops: no single libgomp loaded (%s); transfer threads may start OpenMP pools", paths)
        return None
    return ctypes.CDLL(paths.pop()).omp_set_num_threads


def on_passing_thread(fn: Callable[..., T], *args) -> T:
    """fn(*args) on a new thread that ends before this returns (its OpenMP pool ends with it); its
    result, or what it raised. For loading a model before the step thread computes."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-load") as passing:
        return passing.submit(fn, *args).result()  # leaving the block joins the thread
