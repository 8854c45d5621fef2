"""OpenMP threads per thread (services/engine/cpu_threads.py), in this process: a serial thread
computes on its own thread alone, transfer threads copy serially, a passing thread returns its result
(tests/integration/test_cpu_threads_workers.py counts a worker's pools in fresh processes)."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from splitserve.services.disagg.transfer import chunks, torch_dist
from splitserve.services.engine.cpu_threads import on_passing_thread, serial_torch_ops

pytestmark = [
    pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc"),
    pytest.mark.skipif(torch.get_num_threads() < 2, reason="one core: torch starts no OpenMP pool"),
]


def test_a_serial_thread_still_computes():
    out: list[torch.Tensor] = []
    thread = threading.Thread(target=lambda: (serial_torch_ops(), out.append(torch.arange(100_000).sum())))
    thread.start()
    thread.join()
    assert int(out[0]) == sum(range(100_000))


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


@pytest.mark.parametrize("executor", [chunks._HELPERS, torch_dist._EXECUTOR], ids=["chunk helpers", "transfers"])
def test_kv_transfer_threads_copy_serially(executor):
    assert executor.submit(torch.get_num_threads).result() == 1


def test_a_passing_thread_returns_its_result_or_raises_its_error():
    assert on_passing_thread(lambda a, b: a + b, 2, 3) == 5
    with pytest.raises(KeyError, match="nope"):
        on_passing_thread({}.__getitem__, "nope")
