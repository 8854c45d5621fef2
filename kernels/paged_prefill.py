"""paged_prefill_attention: causal attention for packed variable-length queries over paged K/V.

Sequence i owns query tokens [query_start_loc[i], query_start_loc[i+1]) (relative to
query_start_loc[0]) and has seq_lens[i] context tokens, its new tokens last: query j sits at position
seq_len - query_len + j and sees positions <= its own. The new tokens' K/V must already be in the
cache (store_kv first), so a cached prefix (prefix hit, chunked prefill) and a fresh prompt are the
same case.

One program per (sequence, KV head, block of BLOCK_M query tokens). Its rows are the BLOCK_M tokens
times the KV head's group of query heads (row = token * GROUP_PAD + head), so each K/V tile is read
once per group. Tiles wholly below the causal diagonal skip the causal mask.

One compiled variant per model and dtype: the block-table row stride and the alignment of the index
arrays (views that start after the step's decodes) are not specialised on, and the cache strides are
int64 whatever the cache size (see paged_decode.py).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from splitserve.kernels._common import INDEX_DTYPES, check_device, check_shape, check_tensor, dot_dtype
from splitserve.kernels._paged import attend_range, attention_ref, check_paged_inputs, gather_context

_LOG2E = math.log2(math.e)
_BLOCK_N = 64
_ROWS = 64  # query rows per program (tokens x padded group)
_MIN_DOT = 16  # tl.dot needs >= 16 along each dimension on the GPU: pad head_dim


# stride_bt follows the step's longest sequence; block_tables / seq_lens / query_start_loc start after the
# step's decodes (any alignment) and are read one element at a time: neither earns a compiled variant.
@triton.jit(
    do_not_specialize=["stride_bt"],
    do_not_specialize_on_alignment=["block_tables_ptr", "seq_lens_ptr", "query_start_ptr"],
)
def _prefill_kernel(
    q_ptr,
    cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_ptr,
    out_ptr,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_bt,
    stride_cache_kv: tl.int64,  # int64 whatever the value: one variant for every cache size
    stride_cache_block: tl.int64,
    stride_cache_token: tl.int64,
    stride_cache_head: tl.int64,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    m_start = tl.program_id(2) * BLOCK_M
    first = tl.load(query_start_ptr)
    q_start = tl.load(query_start_ptr + seq) - first
    query_len = tl.load(query_start_ptr + seq + 1) - first - q_start
    if m_start >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix_len = seq_len - query_len

    offs_r = tl.arange(0, BLOCK_M * GROUP_PAD)
    offs_m = m_start + offs_r // GROUP_PAD  # [R] query token within the sequence
    heads = kv_head * GROUP + offs_r % GROUP_PAD
    offs_d = tl.arange(0, BLOCK_D)
    row_mask = (offs_m < query_len) & (offs_r % GROUP_PAD < GROUP)
    rd_mask = row_mask[:, None] & (offs_d < HEAD_DIM)[None, :]
    tokens = (q_start + offs_m).to(tl.int64)
    q = tl.load(
        q_ptr + tokens[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :], mask=rd_mask, other=0.0
    )
    q_pos = prefix_len + offs_m  # padding rows (offs_m >= query_len) still see only real tokens

    m_i = tl.full([BLOCK_M * GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_M * GROUP_PAD, BLOCK_D], tl.float32)
    k_base = cache_ptr + kv_head * stride_cache_head
    v_base = k_base + stride_cache_kv
    table = block_tables_ptr + seq * stride_bt
    # Whole tiles that every row of this block sees: no causal mask needed there.
    full_end = (prefix_len + m_start + 1) // BLOCK_N * BLOCK_N
    m_i, l_i, acc = attend_range(
        q,
        m_i,
        l_i,
        acc,
        k_base,
        v_base,
        table,
        q_pos,
        0,
        full_end,
        qk_scale,
        stride_cache_block,
        stride_cache_token,
        HEAD_DIM,
        BLOCK_D,
        BLOCK_N,
        BLOCK_SIZE,
        False,
        DOT_DTYPE,
    )
    causal_end = tl.minimum(seq_len, prefix_len + m_start + BLOCK_M)
    m_i, l_i, acc = attend_range(
        q,
        m_i,
        l_i,
        acc,
        k_base,
        v_base,
        table,
        q_pos,
        full_end,
        causal_end,
        qk_scale,
        stride_cache_block,
        stride_cache_token,
        HEAD_DIM,
        BLOCK_D,
        BLOCK_N,
        BLOCK_SIZE,
        True,
        DOT_DTYPE,
    )
    out = acc / l_i[:, None]
    tl.store(
        out_ptr + tokens[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=rd_mask,
    )


def paged_prefill_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim], all sequences' query tokens packed
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32/int64
    seq_lens: torch.Tensor,  # [num_seqs]: context length including the new tokens
    query_start_loc: torch.Tensor,  # [num_seqs + 1]: token offsets, relative to the first entry
    scale: float,
    *,
    max_query_len: int,  # host copy of the longest query: sizes the grid without a sync
    out: torch.Tensor | None = None,
    check: bool = True,  # False: skip the argument checks (the model's per-step path, checked before)
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    out = torch.empty_like(q) if out is None else out
    if check:
        _check_args(q, kv_cache, block_tables, seq_lens, query_start_loc, out)
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = kv_cache.shape[3]
    num_seqs = seq_lens.shape[0]
    if num_seqs == 0 or max_query_len <= 0:
        return out
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    block_m = max(1, _ROWS // group_pad)
    grid = (num_seqs, num_kv_heads, triton.cdiv(max_query_len, block_m))
    _prefill_kernel[grid](
        q,
        kv_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        out,
        scale * _LOG2E,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        GROUP=group,
        GROUP_PAD=group_pad,
        HEAD_DIM=head_dim,
        BLOCK_M=block_m,
        BLOCK_D=max(_MIN_DOT, triton.next_power_of_2(head_dim)),
        BLOCK_N=_BLOCK_N,
        BLOCK_SIZE=kv_cache.shape[2],
        DOT_DTYPE=dot_dtype(q.dtype),
    )
    return out


def _check_args(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    out: torch.Tensor,
) -> None:
    check_paged_inputs(q, kv_cache, block_tables, seq_lens)
    check_tensor("query_start_loc", query_start_loc, 1, INDEX_DTYPES)
    check_shape("query_start_loc", query_start_loc, (seq_lens.shape[0] + 1,))
    check_shape("out", out, tuple(q.shape))
    if out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError("out must have q's dtype and a unit stride on its last dimension")
    check_device(q, kv_cache, block_tables, seq_lens, query_start_loc, out)


def paged_prefill_attention_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    out = torch.empty_like(q)
    starts = (query_start_loc - query_start_loc[0]).tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        k, v = gather_context(kv_cache, block_tables[i], seq_len)
        out[starts[i] : starts[i + 1]] = attention_ref(q[starts[i] : starts[i + 1]], k, v, scale)
    return out
