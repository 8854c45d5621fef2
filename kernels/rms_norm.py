"""rms_norm: y = weight * normalise(x), float32 statistics, with an optional fused residual add.

Rounding follows transformers (and the torch path in services/model/llama.py): the normalised row is
rounded to x's dtype before the weight multiply, and the fused sum is rounded before it is normalised.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.kernels._common import FLOAT_DTYPES, check_device, check_same_dtype, check_shape, check_tensor


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    stride_x,
    stride_r,
    stride_o,
    eps,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < HIDDEN
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r_ptrs = residual_ptr + row * stride_r + offs
        total = (x + tl.load(r_ptrs, mask=mask, other=0.0).to(tl.float32)).to(residual_ptr.dtype.element_ty)
        tl.store(r_ptrs, total, mask=mask)
        x = total.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, 0) / HIDDEN + eps)
    normed = (x * inv_rms).to(out_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (normed * weight).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    *,
    check: bool = True,
) -> torch.Tensor:
    """x: [num_tokens, hidden]; weight: [hidden]. With residual ([num_tokens, hidden]), first
    residual += x in place, then normalise residual. Returns a new [num_tokens, hidden] tensor.
    check=False skips the argument checks (the model's per-step path, checked before)."""
    if check:
        _check_args(x, weight, residual)
    num_tokens, hidden = x.shape
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if num_tokens == 0:
        return out
    _rms_norm_kernel[(num_tokens,)](
        x,
        x if residual is None else residual,
        weight,
        out,
        x.stride(0),
        0 if residual is None else residual.stride(0),
        out.stride(0),
        eps,
        HIDDEN=hidden,
        BLOCK=triton.next_power_of_2(hidden),
        HAS_RESIDUAL=residual is not None,
    )
    return out


def _check_args(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> None:
    check_tensor("x", x, 2, FLOAT_DTYPES)
    check_tensor("weight", weight, 1, FLOAT_DTYPES)
    num_tokens, hidden = x.shape
    check_shape("weight", weight, (hidden,))
    check_same_dtype(x.dtype, weight=weight)
    if residual is not None:
        check_tensor("residual", residual, 2, FLOAT_DTYPES)
        check_shape("residual", residual, (num_tokens, hidden))
        check_same_dtype(x.dtype, residual=residual)
    check_device(x, weight, *([] if residual is None else [residual]))


def rms_norm_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    if residual is not None:
        residual.add_(x)
        x = residual
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)
