"""The KV transfer's checksums: XXH3-64 (seed 0) of a tensor's bytes, in memory order, on gloo
channels; a position-weighted sum computed on the device (device_checksum) on NCCL channels, whose
bytes never come to the host.

Both sides compute it while the bytes move, one chunk at a time (services/disagg/transfer/chunks.py): the
sender over what it sends, the receiver over what landed in its buffer. The prefill worker reports
its value per piece (TransferDone) and the decode worker fails the handoff with "checksum" when
its own differs, so a corrupted, truncated or misrouted transfer never reaches the cache.

Why XXH3 rather than CRC-32: zlib.crc32 runs at ~4 GB/s on one core here, below the wire's own
rate, and was most of the handoff's cost; XXH3-64 runs at 25-60 GB/s, releases the GIL on large
buffers (so it overlaps the transfer) and, being a hash rather than a sum, still catches reordered
and swapped chunks. Neither is a MAC: the pair's HMAC handshake (torch_dist.py) is what keeps
strangers off a channel.
"""

from __future__ import annotations

import torch
import xxhash

# device_checksum's weights: word i counts (i * _STEP + _OFFSET) | 1 times (odd: a flipped bit always
# shows); 64-bit integer arithmetic wraps, so the sum is exact and the same on any device and order.
_STEP, _OFFSET = -0x61C8864680B583EB, 0x632BE59BD9B4E019  # 0x9E3779B97F4A7C15 as a signed int64
_DEVICE_CHUNK_WORDS = 1 << 22  # bounds the weights' scratch memory (32 MiB)


def _memory(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous host tensor, without a copy."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError(
            f"checksums read contiguous host tensors, got {tensor.device} contiguous={tensor.is_contiguous()}"
        )
    return tensor.detach().view(torch.uint8).reshape(-1).numpy().data


class RunningChecksum:
    """XXH3-64 over consecutive chunks: equal to checksum() of the whole when the chunks cover it in
    order. One per transfer, fed from one thread."""

    def __init__(self) -> None:
        self._state = xxhash.xxh3_64()

    def update(self, chunk: torch.Tensor) -> None:
        self._state.update(_memory(chunk))

    @property
    def value(self) -> int:
        return self._state.intdigest()


def checksum(tensor: torch.Tensor) -> int:
    """XXH3-64 of a tensor's bytes (a device tensor, or a strided one, is copied to the host first)."""
    data = tensor.detach().contiguous()
    if data.device.type != "cpu":
        data = data.cpu()
    return xxhash.xxh3_64_intdigest(_memory(data))


def device_checksum(tensor: torch.Tensor) -> int:
    """sum(w_i * word_i) mod 2**64 over the tensor's 64-bit words (32-bit, or bytes, when its size is
    not a multiple of 8), computed on the tensor's device: one read of the bytes, no copy to the
    host. Catches any flipped bit and, with position weights, moved or swapped words."""
    data = tensor.detach().contiguous().view(-1).view(torch.uint8)
    words = _words(data)
    total = torch.zeros((), dtype=torch.int64, device=data.device)
    for start in range(0, words.numel(), _DEVICE_CHUNK_WORDS):
        part = words[start : start + _DEVICE_CHUNK_WORDS]
        weights = torch.arange(start, start + part.numel(), dtype=torch.int64, device=data.device)
        weights = (weights * _STEP + _OFFSET) | 1
        total += (weights * part).sum()
    return (int(total.item()) + data.numel()) & (2**64 - 1)  # the length too: trailing zeros count


def _words(data: torch.Tensor) -> torch.Tensor:
    for dtype, size in ((torch.int64, 8), (torch.int32, 4)):
        if data.numel() % size == 0:
            return data.view(dtype).to(torch.int64)
    return data.to(torch.int64)
