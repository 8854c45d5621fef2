"""Pieces shared by the paged decode and prefill attention kernels and their wrappers."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.kernels._common import FLOAT_DTYPES, INDEX_DTYPES, check_same_dtype, check_tensor, mma


@triton.jit
def attend_range(
    q,
    m_i,
    l_i,
    acc,  # q [R, BLOCK_D]; m_i, l_i [R] (log2 units); acc [R, BLOCK_D] float32
    k_base,
    v_base,
    table_ptr,
    q_pos,  # q_pos [R]: each query row's position (used when CAUSAL)
    start,
    end,
    qk_scale,
    stride_cache_block,
    stride_cache_token,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    """Online softmax over context tokens [start, end) of one sequence and one KV head.

    Each tile of BLOCK_N tokens may span several cache blocks: every token looks up its own block id
    in the block table (the ids repeat, so those loads hit the cache)."""
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        block_ids = tl.load(table_ptr + offs_n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        rows = block_ids * stride_cache_block + (offs_n % BLOCK_SIZE) * stride_cache_token  # [BLOCK_N]
        kv_off = rows[:, None] + offs_d[None, :]
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_base + kv_off, mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        v = tl.load(v_base + kv_off, mask=kv_mask, other=0.0)
        s = mma(q, tl.trans(k), DOT_DTYPE) * qk_scale  # [R, BLOCK_N]
        if CAUSAL:
            s = tl.where(n_mask[None, :] & (offs_n[None, :] <= q_pos[:, None]), s, float("-inf"))
        else:
            s = tl.where(n_mask[None, :], s, float("-inf"))
        # Every row sees a valid token in its first tile, so m_new is finite and no NaN appears.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + mma(p, v, DOT_DTYPE)
        m_i = m_new
    return m_i, l_i, acc


def check_paged_inputs(
    q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor
) -> tuple[int, int, int]:
    """Checks shared by decode and prefill; returns (num_heads, num_kv_heads, head_dim)."""
    check_tensor("q", q, 3, FLOAT_DTYPES)
    check_tensor("kv_cache", kv_cache, 5, FLOAT_DTYPES)
    check_tensor("block_tables", block_tables, 2, INDEX_DTYPES)
    check_tensor("seq_lens", seq_lens, 1, INDEX_DTYPES)
    check_same_dtype(kv_cache.dtype, q=q)
    if kv_cache.shape[0] != 2:
        raise ValueError(
            f"kv_cache must be [2, num_blocks, block_size, num_kv_heads, head_dim], got {tuple(kv_cache.shape)}"
        )
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    num_heads = q.shape[1]
    if q.shape[2] != head_dim:
        raise ValueError(f"q head_dim {q.shape[2]} != kv_cache head_dim {head_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    if block_tables.shape[0] != seq_lens.shape[0]:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows but seq_lens has {seq_lens.shape[0]}")
    return num_heads, num_kv_heads, head_dim


def gather_context(
    kv_cache: torch.Tensor, block_table: torch.Tensor, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference helper: one sequence's K and V, each [seq_len, num_kv_heads, head_dim]."""
    block_size = kv_cache.shape[2]
    pos = torch.arange(seq_len, device=kv_cache.device)
    blocks = block_table.long()[pos // block_size]
    return kv_cache[0, blocks, pos % block_size], kv_cache[1, blocks, pos % block_size]


def attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Reference: q [ql, h, d] at the last ql positions of k/v [L, kvh, d], causal, float32 math."""
    query_len, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    kf = k.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [h, L, d]
    vf = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = q.float().transpose(0, 1) @ kf.transpose(1, 2) * scale  # [h, ql, L]
    q_pos = torch.arange(seq_len - query_len, seq_len, device=q.device)
    visible = torch.arange(seq_len, device=q.device)[None, :] <= q_pos[:, None]
    scores = scores.masked_fill(~visible, float("-inf"))
    return (scores.softmax(-1) @ vf).transpose(0, 1).to(q.dtype)  # [ql, h, d]
