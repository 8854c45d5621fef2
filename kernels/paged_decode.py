"""paged_decode_attention: one query token per sequence against its paged K/V.

One program per (sequence, KV head, split): the KV head's group of query heads is one [GROUP, D]
tile, so each K/V tile is read once for the whole group and the scores are a tl.dot. With
num_splits > 1 (flash-decoding) each program covers a slice of the context and writes a partial
(unnormalised output, running max, running sum); a second kernel merges the slices. That keeps the
GPU busy when few sequences have long contexts.

Compiled variants (Triton compiles one per constexpr set and per argument specialisation): the split
count is a power of two, so a model meets at most log2(_MAX_SPLITS) + 1 decode variants, each of which
`decode_warm_up_lens` names a context length for (engine warm-up: ModelRunner.warm_up). The block-table
row stride (its width follows the longest sequence of the step) and the index arrays' alignment (the
backend passes views that start at any row) are not specialised on; the cache strides are int64
whatever their values, so the cache's size does not pick the variant.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from splitserve.kernels._common import check_device, check_shape, dot_dtype
from splitserve.kernels._paged import attend_range, attention_ref, check_paged_inputs, gather_context

_LOG2E = math.log2(math.e)
_BLOCK_N = 64  # context tokens per tile
_MIN_DOT = 16  # tl.dot needs >= 16 along each dimension on the GPU: pad the group and head_dim
_MIN_TOKENS_PER_SPLIT = 256
_MAX_SPLITS = 32  # a power of two, like every split count chosen here


# stride_bt changes with the step's longest sequence; block_tables / seq_lens are views at any row offset
# and are read one element at a time, so neither their values nor their alignment earn a variant.
@triton.jit(do_not_specialize=["stride_bt"], do_not_specialize_on_alignment=["block_tables_ptr", "seq_lens_ptr"])
def _decode_kernel(
    q_ptr,
    cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    part_acc_ptr,
    part_ml_ptr,
    qk_scale,
    stride_qs,
    stride_qh,
    stride_os,
    stride_oh,
    stride_bt,
    stride_cache_kv: tl.int64,  # int64 whatever the value: one variant for every cache size
    stride_cache_block: tl.int64,
    stride_cache_token: tl.int64,
    stride_cache_head: tl.int64,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    # Splits are whole tiles; trailing splits of a short sequence are empty (m=-inf, l=0).
    split_len = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + offs_h  # [BLOCK_H] query heads sharing this KV head
    hd_mask = (offs_h < GROUP)[:, None] & (offs_d < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + seq * stride_qs + heads[:, None] * stride_qh + offs_d[None, :], mask=hd_mask, other=0.0)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    k_base = cache_ptr + kv_head * stride_cache_head
    m_i, l_i, acc = attend_range(
        q,
        m_i,
        l_i,
        acc,
        k_base,
        k_base + stride_cache_kv,
        block_tables_ptr + seq * stride_bt,
        0,
        start,
        end,
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
    if NUM_SPLITS == 1:
        out = acc / l_i[:, None]
        tl.store(
            out_ptr + seq * stride_os + heads[:, None] * stride_oh + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=hd_mask,
        )
    else:
        part = (seq * NUM_HEADS + heads) * NUM_SPLITS + split  # [BLOCK_H] row of the partials
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=hd_mask)
        h_mask = offs_h < GROUP
        tl.store(part_ml_ptr + part * 2, m_i, mask=h_mask)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=h_mask)


@triton.jit
def _merge_splits_kernel(
    part_acc_ptr,
    part_ml_ptr,
    out_ptr,
    stride_os,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < NUM_SPLITS
    part = (seq * NUM_HEADS + head) * NUM_SPLITS + offs_s  # [BLOCK_S]
    m = tl.load(part_ml_ptr + part * 2, mask=s_mask, other=float("-inf"))
    l_sum = tl.load(part_ml_ptr + part * 2 + 1, mask=s_mask, other=0.0)
    weight = tl.exp2(m - tl.max(m, 0))  # split 0 is never empty, so the max is finite
    sd_mask = s_mask[:, None] & (offs_d < HEAD_DIM)[None, :]
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], mask=sd_mask, other=0.0)
    out = tl.sum(acc * weight[:, None], 0) / tl.sum(l_sum * weight, 0)  # [BLOCK_D]
    tl.store(
        out_ptr + seq * stride_os + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM
    )


@functools.cache
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (asked once per device, then cached: the wrappers run
    per layer per step); 0 elsewhere."""
    if device.type != "cuda":
        return 0
    return _cuda_sm_count(torch.cuda.current_device() if device.index is None else device.index)


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """Enough splits for about two programs per SM when there are few (sequence, KV head) pairs,
    but at least _MIN_TOKENS_PER_SPLIT context tokens each, rounded down to a power of two (each
    split count is a compiled variant). Host-side only: no device sync. 1 when num_sms is 0 (no GPU)."""
    programs = num_seqs * num_kv_heads
    by_occupancy = -(-2 * num_sms // programs)
    by_length = max(1, max_seq_len // _MIN_TOKENS_PER_SPLIT)
    n = max(1, min(by_occupancy, by_length, _MAX_SPLITS))
    return 1 << (n.bit_length() - 1)


def decode_warm_up_lens(num_kv_heads: int, max_seq_len: int, num_sms: int) -> dict[int, int]:
    """{split count: a one-sequence context length that selects it} for every split count that
    choose_num_splits can return for batches with contexts up to max_seq_len. One sequence gives the
    most splits (more sequences only lower by_occupancy), so these are the powers of two up to its count."""
    top = choose_num_splits(1, num_kv_heads, max_seq_len, num_sms)
    lens = {1: 1}
    splits = 2
    while splits <= top:
        lens[splits] = splits * _MIN_TOKENS_PER_SPLIT
        splits *= 2
    return lens


def paged_decode_attention(
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32/int64
    seq_lens: torch.Tensor,  # [num_seqs] int32/int64, each >= 1, context incl. this token
    scale: float,
    *,
    max_seq_len: int | None = None,  # host copy of max(seq_lens); picks num_splits without a sync
    num_splits: int | None = None,  # None: choose_num_splits (1 without max_seq_len); any value >= 1
    out: torch.Tensor | None = None,
    check: bool = True,  # False: skip the argument checks (the model's per-step path, checked before)
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    out = torch.empty_like(q) if out is None else out
    if check:
        _check_args(q, kv_cache, block_tables, seq_lens, out, num_splits)
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[3]
    if num_seqs == 0:
        return out
    if num_splits is None:
        num_splits = (
            1 if max_seq_len is None else choose_num_splits(num_seqs, num_kv_heads, max_seq_len, sm_count(q.device))
        )
    group = num_heads // num_kv_heads
    block_d = max(_MIN_DOT, triton.next_power_of_2(head_dim))
    if num_splits > 1:  # partials in float32; from the caching allocator, so no sync here
        part_acc = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(num_seqs, num_heads, num_splits, 2, dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out  # unused
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q,
        kv_cache,
        block_tables,
        seq_lens,
        out,
        part_acc,
        part_ml,
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
        NUM_HEADS=num_heads,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_H=max(_MIN_DOT, triton.next_power_of_2(group)),
        BLOCK_D=block_d,
        BLOCK_N=_BLOCK_N,
        BLOCK_SIZE=kv_cache.shape[2],
        NUM_SPLITS=num_splits,
        DOT_DTYPE=dot_dtype(q.dtype),
    )
    if num_splits > 1:
        _merge_splits_kernel[(num_seqs, num_heads)](
            part_acc,
            part_ml,
            out,
            out.stride(0),
            out.stride(1),
            NUM_HEADS=num_heads,
            HEAD_DIM=head_dim,
            NUM_SPLITS=num_splits,
            BLOCK_S=triton.next_power_of_2(num_splits),
            BLOCK_D=block_d,
        )
    return out


def _check_args(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    num_splits: int | None,
) -> None:
    check_paged_inputs(q, kv_cache, block_tables, seq_lens)
    check_shape("seq_lens", seq_lens, (q.shape[0],))
    check_shape("out", out, tuple(q.shape))
    if out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError("out must have q's dtype and a unit stride on its last dimension")
    check_device(q, kv_cache, block_tables, seq_lens, out)
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")


def paged_decode_attention_ref(
    q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float
) -> torch.Tensor:
    out = torch.empty_like(q)
    for i, seq_len in enumerate(seq_lens.tolist()):
        k, v = gather_context(kv_cache, block_tables[i], seq_len)
        out[i] = attention_ref(q[i : i + 1], k, v, scale)[0]
    return out
