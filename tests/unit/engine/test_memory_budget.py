"""The KV cache budget on a GPU: --gpu-memory-fraction of TOTAL memory, less the weights, the peak of
one profiling forward and memory outside torch; several workers can share a device. On CPU: the
torch.cuda memory calls are mocked by a fake device whose counters the test moves."""

from __future__ import annotations

import logging

import pytest
import torch

from splitserve.services.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from splitserve.services.engine.engine import Engine
from splitserve.services.engine.memory import MemorySnapshot, profile_memory
from splitserve.services.engine.model_runner import _profile_seq_lens, kv_block_bytes

GIB = 1024**3
DEVICE = torch.device("cuda", 0)


class FakeGpu:
    """One device shared by every process: torch's caching allocator of this process, and memory
    others (or CUDA itself) take."""

    def __init__(self, total: int, free: int) -> None:
        self.total, self.free = total, free
        self.allocated = self.reserved = self.peak = 0

    def alloc(self, n: int) -> None:
        self.allocated += n
        self.peak = max(self.peak, self.allocated)
        if self.allocated > self.reserved:  # the allocator asks the device for more
            self.free -= self.allocated - self.reserved
            self.reserved = self.allocated

    def release(self, n: int) -> None:
        self.allocated -= n  # stays reserved (cached) until empty_cache

    def take_outside_torch(self, n: int) -> None:
        self.free -= n

    def empty_cache(self) -> None:
        self.free += self.reserved - self.allocated
        self.reserved = self.allocated

    def reset_peak(self, device=None) -> None:
        self.peak = self.allocated

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        for name, fn in {
            "mem_get_info": lambda device=None: (self.free, self.total),
            "memory_allocated": lambda device=None: self.allocated,
            "memory_reserved": lambda device=None: self.reserved,
            "max_memory_allocated": lambda device=None: self.peak,
            "reset_peak_memory_stats": self.reset_peak,
            "synchronize": lambda device=None: None,
            "empty_cache": self.empty_cache,
        }.items():
            monkeypatch.setattr(torch.cuda, name, fn)


def start_worker(gpu: FakeGpu, weights: int, activations: int, outside_torch: int):
    """What ModelRunner does on a GPU: snapshot, load, profile; returns the profile."""
    before = MemorySnapshot.take(DEVICE)
    gpu.alloc(weights)

    def forward():
        gpu.alloc(activations)
        gpu.take_outside_torch(outside_torch)  # e.g. cuBLAS workspace, Triton modules
        gpu.release(activations)

    return profile_memory(DEVICE, before, forward)


def test_budget_is_fraction_of_total_less_weights_activations_and_non_torch(monkeypatch):
    gpu = FakeGpu(total=80 * GIB, free=79 * GIB)  # 1 GiB: the CUDA context, before anything
    gpu.install(monkeypatch)
    profile = start_worker(gpu, weights=16 * GIB, activations=3 * GIB, outside_torch=GIB // 2)
    assert (profile.weights_bytes, profile.activation_bytes, profile.non_torch_bytes) == (16 * GIB, 3 * GIB, GIB // 2)
    assert profile.free_bytes == 79 * GIB - 16 * GIB - GIB // 2  # the activations went back (empty_cache)
    assert profile.kv_cache_bytes(0.85) == int(0.85 * 80 * GIB) - 16 * GIB - 3 * GIB - GIB // 2
    assert "0.85 x 80.00 GiB total - 16.00 GiB weights - 3.00 GiB peak activations" in profile.describe(0.85)


def test_too_small_a_fraction_is_a_clear_error(monkeypatch):
    gpu = FakeGpu(total=80 * GIB, free=80 * GIB)
    gpu.install(monkeypatch)
    profile = start_worker(gpu, weights=16 * GIB, activations=3 * GIB, outside_torch=0)
    with pytest.raises(
        ValueError,
        match=r"no GPU memory left for the KV cache: 0.2 x 80.00 GiB total.*"
        r"Raise --gpu-memory-fraction",
    ):
        profile.kv_cache_bytes(0.2)


def test_two_workers_share_a_gpu_by_fractions(monkeypatch):
    gpu = FakeGpu(total=80 * GIB, free=80 * GIB)
    gpu.install(monkeypatch)
    kv_bytes = int(0.45 * 80 * GIB) - 8 * GIB - 2 * GIB
    for _ in range(2):  # one after another, as the launcher starts them
        profile = start_worker(gpu, weights=8 * GIB, activations=2 * GIB, outside_torch=0)
        assert profile.kv_cache_bytes(0.45) == kv_bytes
        gpu.alloc(kv_bytes)
        gpu.allocated = gpu.reserved = gpu.peak = 0  # the next worker is another process
    assert gpu.free == 80 * GIB - 2 * (8 * GIB + kv_bytes)  # both fit, with their activation room free


def test_fractions_summing_over_one_fail_in_the_second_worker(monkeypatch):
    gpu = FakeGpu(total=80 * GIB, free=80 * GIB)
    gpu.install(monkeypatch)
    first = start_worker(gpu, weights=8 * GIB, activations=2 * GIB, outside_torch=0)
    gpu.alloc(first.kv_cache_bytes(0.85))
    gpu.allocated = gpu.reserved = gpu.peak = 0
    second = start_worker(gpu, weights=8 * GIB, activations=2 * GIB, outside_torch=0)
    with pytest.raises(ValueError, match="other processes use it.*must sum to less than 1"):
        second.kv_cache_bytes(0.85)


@pytest.fixture(scope="module")
def runner(tiny_llama_dir):
    config = EngineConfig(model=str(tiny_llama_dir), cache=CacheConfig(block_size=8, kv_cache_bytes=2**21))
    return Engine(config).runner


def test_model_runner_sizes_blocks_from_the_profile_and_logs_them(runner, monkeypatch, caplog):
    gpu = FakeGpu(total=8 * GIB, free=8 * GIB)
    gpu.install(monkeypatch)
    profiled = []

    def fake_profile_forward(num_tokens, max_num_seqs, max_model_len):
        profiled.append((num_tokens, max_num_seqs, max_model_len))
        gpu.alloc(GIB)
        gpu.release(GIB)

    monkeypatch.setattr(runner, "profile_forward", fake_profile_forward)
    monkeypatch.setattr(runner, "device", DEVICE)  # only the budget code runs with it
    config = EngineConfig(
        cache=CacheConfig(block_size=8, gpu_memory_fraction=0.5),
        scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=512),
    )
    before = MemorySnapshot.take(DEVICE)
    gpu.alloc(2 * GIB)  # the weights
    with caplog.at_level(logging.INFO, logger="splitserve.services.engine"):
        num_blocks = runner._num_kv_blocks(config, 256, before)
    assert profiled == [(512, 16, 256)]
    assert num_blocks == (4 * GIB - 2 * GIB - GIB) // kv_block_bytes(runner.arch, 8, runner.dtype)
    (record,) = [r for r in caplog.records if r.getMessage().startswith("KV cache:")]
    assert f"{num_blocks} blocks of 8 tokens" in record.getMessage() and "0.5 x 8.00 GiB total" in record.getMessage()


def test_profile_forward_runs_at_the_token_budget(runner):
    calls = []
    real = runner.model.forward

    def forward(input_ids, positions, kv_caches, meta, on_layer=None):
        calls.append((input_ids.shape[0], meta.query_lens_cpu))
        return real(input_ids, positions, kv_caches, meta, on_layer)

    runner.model.forward = forward
    try:
        runner.profile_forward(100, 8, 32)
    finally:
        del runner.model.forward
    assert calls == [(100, [1] * 7 + [32, 32, 29])]


@pytest.mark.parametrize(
    "num_tokens,max_num_seqs,max_model_len", [(2048, 64, 8192), (100, 8, 32), (5, 64, 4), (64, 64, 4), (1, 1, 2)]
)
def test_profile_seq_lens(num_tokens, max_num_seqs, max_model_len):
    lens = _profile_seq_lens(num_tokens, max_num_seqs, max_model_len)
    assert sum(lens) == num_tokens and max(lens) <= max_model_len and min(lens) >= 1
    assert lens[: min(max_num_seqs, num_tokens) - 1] == [1] * (min(max_num_seqs, num_tokens) - 1)
