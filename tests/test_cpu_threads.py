"""One OpenMP pool per worker process (engine/cpu_threads.py): transfer threads copy serially, and a
worker's model is loaded on a thread that ends, so the step thread's pool is the only one.

A pool shows as OS threads of the process (/proc/self/task) that stay while the thread that started
it lives; torch.get_num_threads() is the calling thread's OpenMP thread count."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from splitserve.disagg.transfer import chunks, torch_dist
from splitserve.engine.cpu_threads import on_passing_thread, serial_torch_ops

pytestmark = [
    pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc"),
    pytest.mark.skipif(torch.get_num_threads() < 2, reason="one core: torch starts no OpenMP pool"),
]


def parallel_op() -> None:
    """An op large enough that torch runs it in parallel (far above its 32,768-element grain)."""
    torch.ones(1 << 22).add_(1)


def num_os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def threads_started_by(setup: Callable[[], None]) -> int:
    """OS threads a new thread leaves behind it while alive after setup() then parallel_op()."""
    ran, release = threading.Event(), threading.Event()

    def body() -> None:
        setup()
        parallel_op()
        ran.set()
        release.wait()

    thread = threading.Thread(target=body)
    before = num_os_threads()
    thread.start()
    ran.wait()
    during = num_os_threads()
    release.set()
    thread.join()
    return during - before - 1  # less the thread itself


@pytest.mark.unit
def test_a_thread_running_a_parallel_op_starts_a_pool_it_keeps():
    # What the other tests rely on: this is how a pool shows.
    assert threads_started_by(lambda: None) >= 1


@pytest.mark.unit
def test_a_serial_thread_starts_no_pool_and_still_computes():
    assert threads_started_by(serial_torch_ops) == 0
    out: list[torch.Tensor] = []
    thread = threading.Thread(target=lambda: (serial_torch_ops(), out.append(torch.arange(100_000).sum())))
    thread.start()
    thread.join()
    assert int(out[0]) == sum(range(100_000))


@pytest.mark.unit
def test_the_serial_setting_is_the_calling_threads_alone():
    threads = torch.get_num_threads()
    with ThreadPoolExecutor(1, initializer=serial_torch_ops) as pool:
        assert pool.submit(torch.get_num_threads).result() == 1
    assert torch.get_num_threads() == threads
    other: list[int] = []
    thread = threading.Thread(target=lambda: other.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    assert other == [threads]


@pytest.mark.unit
@pytest.mark.parametrize("executor", [chunks._HELPERS, torch_dist._EXECUTOR], ids=["chunk helpers", "transfers"])
def test_kv_transfer_threads_copy_serially(executor):
    assert executor.submit(torch.get_num_threads).result() == 1


@pytest.mark.unit
def test_a_passing_thread_returns_its_result_or_raises_its_error():
    assert on_passing_thread(lambda a, b: a + b, 2, 3) == 5
    with pytest.raises(KeyError, match="nope"):
        on_passing_thread({}.__getitem__, "nope")


# A fresh process, so that no earlier test left a pool on its main thread: the worker's startup
# (serve_worker's load_engine) leaves no pool behind it.
_STARTUP = """
import os, sys, time
import torch
from splitserve.engine.config import CacheConfig, EngineConfig
from splitserve.worker.server import load_engine
torch.randn(4)  # torch's own start-up threads, before counting
before = len(os.listdir("/proc/self/task"))
engine = load_engine(EngineConfig(model=sys.argv[1], dtype="float32", cache=CacheConfig(kv_cache_bytes=64 << 20)))
deadline = time.monotonic() + 10  # an ended thread's pool winds down just after it
while len(os.listdir("/proc/self/task")) > before and time.monotonic() < deadline:
    time.sleep(0.05)
print(len(os.listdir("/proc/self/task")) - before)
"""


@pytest.mark.integration
def test_a_worker_loads_its_model_on_a_thread_that_ends(tiny_llama_dir):
    out = subprocess.run(
        [sys.executable, "-c", _STARTUP, str(tiny_llama_dir)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == "0"
