"""How many bytes a worker's KV cache may take on its GPU, as vLLM sizes it: the worker's share of the
device (--gpu-memory-fraction x TOTAL memory), less what the worker itself needs besides: its weights,
the peak activations of one profiling forward at the token budget, and memory outside torch's
allocator that appeared while it loaded and profiled (CUDA context growth, cuBLAS workspaces, Triton
modules).

Several workers can share a GPU: each takes its own fraction (the fractions must sum to less than 1,
by at least each worker's CUDA context, ~0.5 GiB, which exists before the first snapshot and is not
counted) and they start one after another (services/launcher/launcher.py), so each measures while the others
sit still.
All numbers come from torch.cuda, so the arithmetic is tested on CPU with those calls mocked.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

_GIB = 1024**3


@dataclass(frozen=True, slots=True)
class MemorySnapshot:
    free_bytes: int  # on the device, for every process (cudaMemGetInfo)
    total_bytes: int
    allocated_bytes: int  # by this process's torch tensors
    reserved_bytes: int  # by this process's torch caching allocator (allocated + cached)

    @classmethod
    def take(cls, device: torch.device) -> MemorySnapshot:
        free, total = torch.cuda.mem_get_info(device)
        return cls(free, total, torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device))


@dataclass(frozen=True, slots=True)
class MemoryProfile:
    total_bytes: int
    free_bytes: int  # after profiling, with torch's cache emptied
    weights_bytes: int
    activation_bytes: int  # peak of the profiling forward above the weights
    non_torch_bytes: int

    def kv_cache_bytes(self, fraction: float) -> int:
        """This worker's share of the device left for its KV cache; ValueError if none is left, or if
        other processes hold so much that it would not fit."""
        kv_bytes = int(self.total_bytes * fraction) - self.weights_bytes - self.activation_bytes - self.non_torch_bytes
        if kv_bytes <= 0:
            raise ValueError(
                f"no GPU memory left for the KV cache: {self.describe(fraction)} = {_gib(kv_bytes)}. "
                "Raise --gpu-memory-fraction, or lower --max-num-batched-tokens (the activations)"
            )
        if kv_bytes > self.free_bytes:
            raise ValueError(
                f"the KV cache would take {_gib(kv_bytes)} ({self.describe(fraction)}) but only "
                f"{_gib(self.free_bytes)} of the GPU is free: other processes use it. The "
                "--gpu-memory-fraction of all workers on one GPU must sum to less than 1"
            )
        return kv_bytes

    def describe(self, fraction: float) -> str:
        return (
            f"{fraction} x {_gib(self.total_bytes)} total - {_gib(self.weights_bytes)} weights - "
            f"{_gib(self.activation_bytes)} peak activations - {_gib(self.non_torch_bytes)} outside torch"
        )


def profile_memory(device: torch.device, before_load: MemorySnapshot, forward: Callable[[], None]) -> MemoryProfile:
    """Run forward (the largest step the scheduler can make) and measure this worker's memory;
    before_load was taken before the weights were loaded."""
    loaded = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    forward()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    torch.cuda.empty_cache()  # the activations' freed blocks go back to the device
    after = MemorySnapshot.take(device)
    used = before_load.free_bytes - after.free_bytes  # by this process since, if no other one started
    torch_growth = after.reserved_bytes - before_load.reserved_bytes
    return MemoryProfile(
        total_bytes=after.total_bytes,
        free_bytes=after.free_bytes,
        weights_bytes=loaded - before_load.allocated_bytes,
        activation_bytes=peak - loaded,
        non_torch_bytes=max(0, used - torch_growth),
    )


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / _GIB:.2f} GiB"
