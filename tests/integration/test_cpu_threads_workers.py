"""One OpenMP pool per worker process (services/engine/cpu_threads.py): transfer threads copy serially, and a
worker's model is loaded on a thread that ends, so the step thread's pool is the only one.

A pool shows as OS threads of the process (/proc/self/task) that stay while the thread that started
it lives (counted in a fresh process); torch.get_num_threads() is the calling thread's OpenMP thread
count."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytestmark = [
    pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc"),
    pytest.mark.skipif(torch.get_num_threads() < 2, reason="one core: torch starts no OpenMP pool"),
]


# Counting a process's threads needs a process of its own: in pytest's, threads of earlier tests
# (executors, an ended thread's pool) start and end meanwhile.
_COUNT = """
import os, sys, threading, time
import torch
from splitserve.services.engine.cpu_threads import serial_torch_ops

def count():
    return len(os.listdir("/proc/self/task"))

def settled(before):  # an ended thread's pool winds down just after it
    deadline = time.monotonic() + 10
    while count() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    return count() - before

def parallel_op():
    torch.ones(1 << 22).add_(1)  # far above torch's 32,768-element grain: runs in parallel

def left_by_a_live_thread(setup):
    ran, release = threading.Event(), threading.Event()
    def body():
        setup(); parallel_op(); ran.set(); release.wait()
    thread = threading.Thread(target=body)
    before = count()
    thread.start(); ran.wait()
    during = count() - before - 1  # less the thread itself
    release.set(); thread.join()
    settled(before)
    return during

torch.randn(4)  # torch's own start-up threads, before counting
case = sys.argv[1]
if case == "plain":
    print(left_by_a_live_thread(lambda: None))
elif case == "serial":
    print(left_by_a_live_thread(serial_torch_ops))
else:
    from splitserve.services.engine.config import CacheConfig, EngineConfig
    from splitserve.services.engine.step_loop import load_engine
    before = count()
    load_engine(EngineConfig(model=case, dtype="float32", cache=CacheConfig(kv_cache_bytes=64 << 20)))
    print(settled(before))
"""


def threads_left(case: str) -> int:
    """In a fresh process: OS threads left behind (a pool) by a live thread that ran a parallel op
    ("plain", or "serial" after serial_torch_ops), or by load_engine of the model at this path."""
    out = subprocess.run([sys.executable, "-c", _COUNT, case], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return int(out.stdout.split()[-1])


def test_a_thread_running_a_parallel_op_keeps_a_pool_but_a_serial_one_does_not():
    assert threads_left("plain") >= 1  # how a pool shows: what the other counts rely on
    assert threads_left("serial") == 0


def test_a_worker_loads_its_model_on_a_thread_that_ends(tiny_llama_dir):
    assert threads_left(str(tiny_llama_dir)) == 0
