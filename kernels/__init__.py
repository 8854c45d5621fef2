"""Triton kernels for the paged KV cache, each beside its torch wrapper and a plain-torch `*_ref`.

Triton fixes at import time whether kernels are compiled or interpreted: on CPU (tests), set
TRITON_INTERPRET=1 before this package is first imported.
"""

from splitserve.kernels.paged_decode import paged_decode_attention, paged_decode_attention_ref
from splitserve.kernels.paged_prefill import paged_prefill_attention, paged_prefill_attention_ref
from splitserve.kernels.rms_norm import rms_norm, rms_norm_ref
from splitserve.kernels.rotary_embedding import rope_cos_sin, rotary_embedding, rotary_embedding_ref
from splitserve.kernels.silu_and_mul import silu_and_mul, silu_and_mul_ref
from splitserve.kernels.store_kv import store_kv, store_kv_ref

__all__ = [
    "paged_decode_attention",
    "paged_decode_attention_ref",
    "paged_prefill_attention",
    "paged_prefill_attention_ref",
    "rms_norm",
    "rms_norm_ref",
    "rope_cos_sin",
    "rotary_embedding",
    "rotary_embedding_ref",
    "silu_and_mul",
    "silu_and_mul_ref",
    "store_kv",
    "store_kv_ref",
]
