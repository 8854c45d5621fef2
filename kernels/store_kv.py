"""store_kv: write the step's new K and V into their paged cache slots.

Cache layout (see services/model/attention/backend.py): [2, num_blocks, block_size, num_kv_heads,
head_dim]; a token's flat slot is block_id * block_size + offset. A negative slot (PAD_SLOT_ID) is
skipped: the padded rows of a CUDA-graph decode step (services/engine/cuda_graphs.py) write nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.kernels._common import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_device,
    check_same_dtype,
    check_shape,
    check_tensor,
)

# The slot of a token whose K/V must not be stored: a padding row of a captured decode step; the same
# value as splitserve.services.model.attention.backend.PAD_SLOT_ID (these kernels import nothing of the model).
PAD_SLOT_ID = -1


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cache_kv: tl.int64,  # int64 whatever the value: one variant for every cache size
    stride_cache_block: tl.int64,
    stride_cache_token: tl.int64,
    stride_cache_head: tl.int64,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    dst = cache_ptr + (slot // BLOCK_SIZE) * stride_cache_block + (slot % BLOCK_SIZE) * stride_cache_token
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h < NUM_KV_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]
    k = tl.load(k_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    mask = mask & (slot >= 0)  # PAD_SLOT_ID: a padding row stores nothing (dst is then out of range)
    dst_off = offs_h[:, None] * stride_cache_head + offs_d[None, :]  # [BLOCK_H, BLOCK_D]
    tl.store(dst + dst_off, k, mask=mask)
    tl.store(dst + stride_cache_kv + dst_off, v, mask=mask)


def store_kv(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, *, check: bool = True
) -> None:
    """kv_cache[0/1] at slot_mapping[i] <- k[i] / v[i], for every slot >= 0 (PAD_SLOT_ID: skipped).

    k, v: [num_tokens, num_kv_heads, head_dim]; kv_cache: [2, num_blocks, block_size, num_kv_heads,
    head_dim] of the same dtype; slot_mapping: [num_tokens] int32/int64, each slot < num_blocks *
    block_size (not checked on the device: that would be a host sync). check=False skips the argument
    checks (a caller that checked the same kind of arguments before: the model's per-step path).
    """
    if check:
        _check_args(k, v, kv_cache, slot_mapping)
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    num_tokens = k.shape[0]
    if num_tokens == 0:
        return
    _store_kv_kernel[(num_tokens,)](
        k,
        v,
        kv_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )


def _check_args(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    check_tensor("kv_cache", kv_cache, 5, FLOAT_DTYPES)
    _, _, _, num_kv_heads, head_dim = kv_cache.shape
    check_tensor("k", k, 3, FLOAT_DTYPES)
    check_tensor("v", v, 3, FLOAT_DTYPES)
    check_tensor("slot_mapping", slot_mapping, 1, INDEX_DTYPES)
    num_tokens = k.shape[0]
    check_shape("k", k, (num_tokens, num_kv_heads, head_dim))
    check_shape("v", v, (num_tokens, num_kv_heads, head_dim))
    check_shape("slot_mapping", slot_mapping, (num_tokens,))
    check_same_dtype(kv_cache.dtype, k=k, v=v)
    check_device(k, v, kv_cache, slot_mapping)


def store_kv_ref(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)
    stored = slot_mapping >= 0  # PAD_SLOT_ID rows are skipped
    flat[0][slot_mapping[stored].long()] = k[stored]
    flat[1][slot_mapping[stored].long()] = v[stored]
