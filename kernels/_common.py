"""Checks shared by the kernel wrappers, and the facts they need about how Triton runs here."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

# Triton decides when a kernel is decorated (at import: triton.language's own helpers when triton is
# imported, ours when this package is) whether it is compiled or interpreted; fixed for the process.
# Launching interpreted kernels also needs TRITON_INTERPRET=1 still set (nested calls are re-decorated).
INTERPRETED: bool = bool(triton.knobs.runtime.interpret)
if INTERPRETED != isinstance(tl.cdiv, InterpretedFunction):
    raise RuntimeError(
        "TRITON_INTERPRET changed between importing triton and splitserve.kernels; "
        "set it before triton is first imported"
    )

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)

_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def check_device(*tensors: torch.Tensor) -> None:
    """All on one device, and one where these kernels can run (CUDA, or CPU under the interpreter)."""
    device = tensors[0].device
    for t in tensors[1:]:
        if t.device != device:
            raise ValueError(f"all tensors must be on one device, got {device} and {t.device}")
    if device.type == "cuda" or (device.type == "cpu" and INTERPRETED):
        if INTERPRETED and not triton.knobs.runtime.interpret:
            raise RuntimeError("kernels were imported under TRITON_INTERPRET=1, which must stay set to launch them")
        return
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("TRITON_INTERPRET=1 was set after triton was imported; set it before the first import")
    raise RuntimeError(f"Triton kernels run on CUDA devices, or on CPU under TRITON_INTERPRET=1; got {device}")


def check_tensor(name: str, t: torch.Tensor, ndim: int, dtypes: tuple[torch.dtype, ...]) -> None:
    """Rank, dtype and a unit stride on the last dimension (every kernel reads rows as vectors)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if t.numel() and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension, got strides {t.stride()}")


def check_shape(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")


def check_same_dtype(dtype: torch.dtype, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.dtype != dtype:
            raise ValueError(f"{name} must have dtype {dtype} like the other inputs, got {t.dtype}")


def dot_dtype(dtype: torch.dtype) -> tl.dtype:
    """Operand type for tl.dot. The interpreter (Triton 3.6-3.8) multiplies bfloat16 as its raw
    uint16 bits, so bf16 operands go through float32 there; compiled kernels use bf16 as is."""
    if dtype == torch.bfloat16 and INTERPRETED:
        return tl.float32
    return _TL_DTYPES[dtype]


@triton.jit
def mma(a, b, DOT_DTYPE: tl.constexpr):
    """a @ b with a float32 accumulator; float32 operands in full precision (no TF32)."""
    if DOT_DTYPE == tl.float32:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        acc = tl.dot(a.to(DOT_DTYPE), b.to(DOT_DTYPE))
    return acc
