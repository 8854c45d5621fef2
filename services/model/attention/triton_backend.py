"""Triton paged attention: store_kv, then the paged decode and prefill kernels of splitserve.kernels;
and the model's RMSNorm (residual add fused), RoPE and SiLU-and-mul as kernels too (TritonOps).

Runs on CUDA, or on CPU under TRITON_INTERPRET=1 (tests only: the interpreter is slow). Triton and
splitserve.kernels are imported when the backend is built, not when this module is: Triton fixes at
import whether kernels are compiled or interpreted, and a missing triton package must only make this
backend unavailable.

No host syncs in forward: grid sizes and the split-K count come from the host copies in the metadata
(seq_lens_cpu, query_lens_cpu). For CUDA-graph capture of decode steps the split count must stay fixed
per captured batch size; today it follows max(seq_lens_cpu).
"""

from __future__ import annotations

import importlib.util
import os

import torch

from splitserve.services.model.attention.backend import (
    AttentionBackend,
    AttentionMetadata,
    ModelOps,
    register_backend,
)


def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


class TritonOps(ModelOps):
    """ModelOps on splitserve.kernels, rounding as the torch versions do (see the kernels' docstrings)."""

    def __init__(self, kernels) -> None:
        self.kernels = kernels

    def rms_norm(self, x, weight, eps):
        return self.kernels.rms_norm(x, weight, eps)

    def add_rms_norm(self, x, residual, weight, eps):
        return self.kernels.rms_norm(x, weight, eps, residual=residual), residual  # residual += x in place

    def rope_lookup(self, cos, sin, positions, dtype):
        # The kernel reads float32 [max_len, head_dim // 2] rows (strided views) by position itself.
        half = cos.shape[1] // 2
        return positions, cos[:, :half], sin[:, :half]

    def rotate(self, q, k, rope):
        positions, cos, sin = rope
        self.kernels.rotary_embedding(positions, q, k, cos, sin)  # in place
        return q, k

    def silu_and_mul(self, gate_up):
        return self.kernels.silu_and_mul(gate_up)


@register_backend
class TritonAttention(AttentionBackend):
    name = "triton"

    @classmethod
    def check_supported(cls, device: torch.device) -> None:
        if not triton_installed():
            raise RuntimeError("the 'triton' attention backend needs the triton package (pip install triton); "
                               "or pass --attention-backend torch")
        if device.type == "cuda":
            return
        if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
            import splitserve.kernels  # noqa: F401  raises if triton was imported before the variable was set
            return
        raise RuntimeError(f"the 'triton' attention backend runs on CUDA, or on CPU only under the Triton "
                           f"interpreter (TRITON_INTERPRET=1, slow, for tests); device is {device}. "
                           "Pass --attention-backend torch")

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, block_size)
        from splitserve import kernels

        self.kernels = kernels
        self.ops = TritonOps(kernels)

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        kernels, nd = self.kernels, meta.num_decodes
        kernels.store_kv(k, v, kv_cache, meta.slot_mapping)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # q may be a strided view of qkv
        if nd:  # decodes come first, one token each
            kernels.paged_decode_attention(
                q[:nd], kv_cache, meta.block_tables[:nd], meta.seq_lens[:nd], self.scale,
                max_seq_len=max(meta.seq_lens_cpu[:nd]), out=out[:nd])
        if nd < meta.num_seqs:
            kernels.paged_prefill_attention(
                q[nd:], kv_cache, meta.block_tables[nd:], meta.seq_lens[nd:], meta.query_start_loc[nd:],
                self.scale, max_query_len=max(meta.query_lens_cpu[nd:]), out=out[nd:])
        return out
