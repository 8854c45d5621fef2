"""Plain-torch operations on the paged KV cache (layout: attention/backend.py) shared by the torch
backend and its decode mirror: store new tokens, gather whole blocks, and the additive masks SDPA takes."""

from __future__ import annotations

import torch


def store_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write new tokens' K and V ([num_tokens, num_kv_heads, head_dim]) into their cache slots."""
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)
    flat[0].index_copy_(0, slot_mapping, k)
    flat[1].index_copy_(0, slot_mapping, v)


def gather_kv(kv_cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """K and V of whole blocks, block_ids [n] in order: [2, n * block_size, num_kv_heads, head_dim]."""
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    src = kv_cache.view(2, num_blocks, -1)  # [2, num_blocks, one block's K (or V)]
    out = src.new_empty(2, len(block_ids), src.shape[2])
    # Whole blocks along dim 0 of a contiguous tensor: row copies, split over the threads (along dim 1
    # index_select runs on one thread; kv_cache[:, block_ids] is slower still).
    torch.index_select(src[0], 0, block_ids, out=out[0])
    torch.index_select(src[1], 0, block_ids, out=out[1])
    return out.view(2, len(block_ids) * block_size, num_kv_heads, head_dim)


def additive_mask(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask as SDPA adds it to the scores: 0 where visible, -inf elsewhere."""
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, float("-inf"))
