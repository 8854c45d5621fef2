"""Copying whole KV blocks out of and into the cache: what a KV handoff reads and writes on each
side (the transport only moves the contiguous tensor these make; services/disagg/transfer/checksum.py checks
it)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def _rows(kv: torch.Tensor) -> torch.Tensor:
    # [layers * 2, blocks, block elements]: indexing whole rows of a 3-D view copies contiguous
    # memory; index_select on dim 2 of the 6-D tensor is ~100x slower on CPU.
    return kv.view(kv.shape[0] * kv.shape[1], kv.shape[2], -1)


def gather_blocks(
    kv_cache: torch.Tensor, block_ids: Sequence[int], out: torch.Tensor | None = None, rows: slice | None = None
) -> torch.Tensor:
    """[num_layers, 2, num_blocks, ...] cache -> contiguous [num_layers, 2, len(block_ids), ...] copy
    (into out, a contiguous tensor of that shape, when given). rows (with out): only these of the
    [num_layers * 2] leading rows, so a sender can gather a chunk while the previous one is sent."""
    index = torch.tensor(block_ids, dtype=torch.int64, device=kv_cache.device)
    shape = kv_cache.shape[:2] + (len(block_ids),) + kv_cache.shape[3:]
    if out is not None:
        part = slice(None) if rows is None else rows
        torch.index_select(_rows(kv_cache)[part], 1, index, out=_rows(out)[part])
        return out
    return _rows(kv_cache).index_select(1, index).view(shape)


def scatter_blocks(
    kv_cache: torch.Tensor, block_ids: Sequence[int], blocks: torch.Tensor, rows: slice | None = None
) -> None:
    """Inverse of gather_blocks: blocks[:, :, i] lands in block block_ids[i], straight from blocks
    (a received buffer) when it is already on the cache's device and dtype. rows: only these of the
    [num_layers * 2] leading rows, so a receiver can write a chunk while the next one arrives."""
    index = torch.tensor(block_ids, dtype=torch.int64, device=kv_cache.device)
    part = slice(None) if rows is None else rows
    source = _rows(blocks.to(kv_cache.device, kv_cache.dtype).contiguous())[part]
    _rows(kv_cache)[part].index_copy_(1, index, source)
