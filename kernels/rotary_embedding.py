"""rotary_embedding: rotate q and k in place by their tokens' positions.

Two layouts of the rotated pairs: neox (rotate-half: element i pairs with i + head_dim/2; Llama,
Qwen2, SmolLM2 checkpoints in HF layout) and GPT-J (interleaved: 2i pairs with 2i+1). The cos/sin
tables are precomputed from the inverse frequencies, so any frequency scaling (linear, llama3, GGUF
frequency factors) is already in them: see rope_cos_sin. Math in float32, rounded once on store.
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


@triton.jit
def _rotate_heads(
    base,
    stride_h,
    cos,
    sin,
    NUM_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    INTERLEAVED: tl.constexpr,
):
    offs_h = tl.arange(0, BLOCK_H)
    offs = tl.arange(0, BLOCK_HALF)
    mask = (offs_h < NUM_HEADS)[:, None] & (offs < HALF)[None, :]
    if INTERLEAVED:
        first, second = 2 * offs, 2 * offs + 1
    else:
        first, second = offs, offs + HALF
    ptr1 = base + offs_h[:, None] * stride_h + first[None, :]  # [BLOCK_H, BLOCK_HALF]
    ptr2 = base + offs_h[:, None] * stride_h + second[None, :]
    x1 = tl.load(ptr1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptr2, mask=mask, other=0.0).to(tl.float32)
    tl.store(ptr1, (x1 * cos[None, :] - x2 * sin[None, :]).to(base.dtype.element_ty), mask=mask)
    tl.store(ptr2, (x2 * cos[None, :] + x1 * sin[None, :]).to(base.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    pos_ptr,
    q_ptr,
    k_ptr,
    cos_ptr,
    sin_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cos,
    stride_sin,
    NUM_Q_HEADS: tl.constexpr,
    NUM_K_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_QH: tl.constexpr,
    BLOCK_KH: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    INTERLEAVED: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    offs = tl.arange(0, BLOCK_HALF)
    cos = tl.load(cos_ptr + pos * stride_cos + offs, mask=offs < HALF, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + pos * stride_sin + offs, mask=offs < HALF, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr + token * stride_qt, stride_qh, cos, sin, NUM_Q_HEADS, HALF, BLOCK_QH, BLOCK_HALF, INTERLEAVED)
    _rotate_heads(k_ptr + token * stride_kt, stride_kh, cos, sin, NUM_K_HEADS, HALF, BLOCK_KH, BLOCK_HALF, INTERLEAVED)


def rope_cos_sin(inv_freq: torch.Tensor, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [max_positions, head_dim // 2], float32, from inverse frequencies
    [head_dim // 2] (e.g. services.model.arch.rope_inv_freq, which applies llama3 scaling)."""
    positions = torch.arange(max_positions, dtype=torch.float32, device=inv_freq.device)
    freqs = positions[:, None] * inv_freq.float()[None, :]
    return freqs.cos(), freqs.sin()


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleaved: bool = False,
    *,
    check: bool = True,
) -> None:
    """In place. positions: [num_tokens] int; q: [num_tokens, num_heads, head_dim]; k: [num_tokens,
    num_kv_heads, head_dim]; cos, sin: [max_positions, head_dim // 2] (rows may be strided).
    Positions must be < max_positions (not checked on the device: that would be a host sync).
    check=False skips the argument checks (the model's per-step path, checked before)."""
    if check:
        _check_args(positions, q, k, cos, sin)
    num_tokens, num_heads, head_dim = q.shape
    if num_tokens == 0:
        return
    half = head_dim // 2
    _rotary_kernel[(num_tokens,)](
        positions,
        q,
        k,
        cos,
        sin,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos.stride(0),
        sin.stride(0),
        NUM_Q_HEADS=num_heads,
        NUM_K_HEADS=k.shape[1],
        HALF=half,
        BLOCK_QH=triton.next_power_of_2(num_heads),
        BLOCK_KH=triton.next_power_of_2(k.shape[1]),
        BLOCK_HALF=triton.next_power_of_2(half),
        INTERLEAVED=interleaved,
    )


def _check_args(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> None:
    check_tensor("positions", positions, 1, INDEX_DTYPES)
    check_tensor("q", q, 3, FLOAT_DTYPES)
    check_tensor("k", k, 3, FLOAT_DTYPES)
    check_tensor("cos", cos, 2, FLOAT_DTYPES)
    check_tensor("sin", sin, 2, FLOAT_DTYPES)
    num_tokens, _, head_dim = q.shape
    if head_dim % 2:
        raise ValueError(f"head_dim must be even, got {head_dim}")
    check_shape("positions", positions, (num_tokens,))
    check_shape("k", k, (num_tokens, k.shape[1], head_dim))
    check_shape("cos", cos, (cos.shape[0], head_dim // 2))
    check_shape("sin", sin, tuple(cos.shape))
    check_same_dtype(q.dtype, k=k)
    check_device(positions, q, k, cos, sin)


def rotary_embedding_ref(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleaved: bool = False,
) -> None:
    c = cos[positions.long()].float()[:, None, :]  # [num_tokens, 1, half]
    s = sin[positions.long()].float()[:, None, :]
    for x in (q, k):
        xf = x.float()
        x1, x2 = (xf[..., 0::2], xf[..., 1::2]) if interleaved else xf.chunk(2, dim=-1)
        y1, y2 = x1 * c - x2 * s, x2 * c + x1 * s
        y = torch.stack((y1, y2), dim=-1).flatten(-2) if interleaved else torch.cat((y1, y2), dim=-1)
        x.copy_(y)
