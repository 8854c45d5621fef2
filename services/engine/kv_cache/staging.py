"""Reused host buffers for KV transfers.

Gathering blocks into, or receiving them into, freshly allocated memory page-faults on every
transfer: that was most of the handoff's cost (180 MiB per 256 SmolLM2 blocks). Buffers here come
in power-of-two block counts and go back to a free list after use, up to max_cached_bytes.
A buffer is handed out as a contiguous [num_layers, 2, n, block_size, kv_heads, head_dim] view of
its storage. Only the event-loop thread acquires and releases; a buffer that a transfer may still
write into (a failed receive) is simply never released.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(eq=False, slots=True)
class Staging:
    tensor: torch.Tensor  # the [layers, 2, n, ...] view to use
    storage: torch.Tensor  # the flat buffer behind it
    capacity: int  # blocks the storage holds


class StagingPool:
    def __init__(self, block_shape: tuple[int, ...], dtype: torch.dtype, max_cached_bytes: int = 1 << 30) -> None:
        self.layers, self.two, *self.inner = block_shape  # (layers, 2, block_size, kv_heads, head_dim)
        self.dtype = dtype
        self.block_numel = self.layers * self.two * int(torch.tensor(self.inner).prod())
        self.max_cached_bytes = max_cached_bytes
        self._free: dict[int, list[torch.Tensor]] = {}
        self._cached_bytes = 0

    def acquire(self, num_blocks: int) -> Staging:
        capacity = 1 << max(0, num_blocks - 1).bit_length()
        free = self._free.get(capacity)
        if free:
            storage = free.pop()
            self._cached_bytes -= storage.numel() * storage.element_size()
        else:
            storage = torch.empty(capacity * self.block_numel, dtype=self.dtype)
        view = storage[: num_blocks * self.block_numel].view(self.layers, self.two, num_blocks, *self.inner)
        return Staging(view, storage, capacity)

    def release(self, staging: Staging) -> None:
        size = staging.storage.numel() * staging.storage.element_size()
        if self._cached_bytes + size <= self.max_cached_bytes:
            self._free.setdefault(staging.capacity, []).append(staging.storage)
            self._cached_bytes += size
