"""silu_and_mul: [num_tokens, 2 * d] (gate | up) -> silu(gate) * up, [num_tokens, d].

Rounding follows torch's F.silu(gate) * up: silu in float32, rounded to the input dtype, then the
product rounded once more.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.kernels._common import FLOAT_DTYPES, check_device, check_tensor

_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, D: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < D
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + D + cols, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (silu * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, *, check: bool = True) -> torch.Tensor:
    """check=False skips the argument checks (the model's per-step path, checked before)."""
    if check:
        check_tensor("x", x, 2, FLOAT_DTYPES)
        if x.shape[1] % 2:
            raise ValueError(f"x's last dimension must be even (gate | up), got {x.shape[1]}")
        check_device(x)
    num_tokens, width = x.shape
    d = width // 2
    out = torch.empty(num_tokens, d, dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    block = min(_BLOCK, triton.next_power_of_2(d))
    _silu_and_mul_kernel[(num_tokens, triton.cdiv(d, block))](x, out, x.stride(0), out.stride(0), D=d, BLOCK=block)
    return out


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up
