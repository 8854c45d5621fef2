"""The attention backend contract and its registry, and the model's other ops a backend provides.

KV cache layout (shared with the Triton kernels and the KV transfer):
    one tensor per layer, [2, num_blocks, block_size, num_kv_heads, head_dim]; index 0 is K, 1 is V.
    Token at position p of a sequence lives in block block_table[p // block_size], row p % block_size;
    its flat slot is block_id * block_size + p % block_size.

Batch layout: tokens of all scheduled sequences are packed back to back ([num_tokens, ...]).
The first num_decodes sequences have exactly one query token each (decodes come first).
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

log = logging.getLogger("splitserve.services.model")

# slot_mapping's value for a token whose K/V must not be stored: a padding row of a decode step replayed
# from a CUDA graph (services/engine/cuda_graphs.py). A device tensor cannot hold None, so this kernel-level
# sentinel stays (vLLM's PAD_SLOT_ID too); kernels/store_kv.py skips it (the same value, pinned by a test).
PAD_SLOT_ID = -1


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64: flat cache slot of each new token (PAD_SLOT_ID: none)
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int64, rows padded with 0
    seq_lens: torch.Tensor  # [num_seqs] int32: context length including this step's tokens
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32: offsets of each sequence's tokens
    num_decodes: int  # leading sequences with a single query token
    max_seq_len: int
    seq_lens_cpu: list[int]  # host copies, so the CPU path never syncs on device tensors
    query_lens_cpu: list[int]
    # The decodes' split count, fixed (a captured decode step's: services/engine/cuda_graphs.py); None: the
    # backend picks one from max(seq_lens_cpu), which a CUDA graph would freeze at its capture.
    decode_num_splits: int | None = None
    # The decodes' sequence ids (Request.arrival_seq: unique in the process), in batch order: what lets a
    # backend keep per-sequence state from step to step (TorchAttention's decode mirror); None: no
    # sequences behind the step (a warm-up shape, a captured graph).
    decode_seq_ids: list[int] | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)


class ModelOps:
    """The model's non-attention ops in plain torch: RMSNorm (alone, or fused with the residual add
    before it), RoPE and SiLU-and-mul. The model runs them through its backend's `ops`, so a backend
    can swap in kernels (TritonAttention: splitserve.kernels) that round the same way.

    RMSNorm follows transformers (float32 statistics, normalised row rounded to x's dtype before the
    weight multiply) so greedy tokens match it exactly; RoPE is neox style (rotate-half: element i
    pairs with i + head_dim/2) from the float32 table the model keeps."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # x: [num_tokens, hidden], weight: [hidden]
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return weight * xf.to(dtype)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(x + residual), x + residual). May write the sum into residual in place: callers
        use the returned stream and never read residual again."""
        total = x + residual
        return self.rms_norm(total, weight, eps), total

    def rope_lookup(self, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> Any:
        """Once per forward: what rotate needs for the step's tokens. cos, sin: [max_len, head_dim]
        float32 (cat(freqs, freqs)); positions: [num_tokens]. Opaque to the model."""
        return cos[positions].unsqueeze(1).to(dtype), sin[positions].unsqueeze(1).to(dtype)

    def rotate(self, q: torch.Tensor, k: torch.Tensor, rope: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [num_tokens, num_heads, head_dim], k: [num_tokens, num_kv_heads, head_dim], both views
        of the QKV projection (may be rotated in place); returns the rotated q and k."""
        return apply_rotary(q, k, *rope)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        # [num_tokens, 2 * intermediate] (gate | up) -> [num_tokens, intermediate]
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    # q: [T, h, d], k: [T, kvh, d], cos/sin: [T, 1, d]
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class AttentionBackend(ABC):
    """Stores the step's new K/V into the paged cache, then attends every query token to its
    sequence's context (cached prefix + new tokens, causal). Also hands the model its other ops
    (`ops`, plain torch unless a backend sets faster ones)."""

    name: ClassVar[str]

    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, decode_mirror_bytes: int | None = 0
    ) -> None:
        """decode_mirror_bytes: what a backend that keeps contiguous copies of the decodes' K/V may spend
        on them per layer (TorchAttention on CPU: attention/decode_mirror.py); None: up to the layer's
        paged cache size; 0: none. Backends that read the paged cache directly ignore it."""
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.block_size = block_size
        self.scale = head_dim**-0.5
        self.ops: ModelOps = ModelOps()

    @classmethod
    def check_supported(cls, device: torch.device) -> None:
        """Raise RuntimeError saying why, if this backend cannot run on device."""

    def warm_up_decode_lens(self, max_seq_len: int, device: torch.device) -> list[int]:
        """Context lengths of one-sequence decode steps (up to max_seq_len) that together reach every
        compiled variant of this backend's decode path, e.g. each split count of a Triton kernel; an
        engine warm-up runs each once before serving. Plain torch compiles nothing: none."""
        return []

    def graph_decode_splits(self, num_seqs: int, max_seq_len: int, device: torch.device) -> int | None:
        """The fixed decode split count (AttentionMetadata.decode_num_splits) of a decode step of num_seqs
        sequences captured in a CUDA graph: correct for any context up to max_seq_len, since a replay
        cannot choose again. None: this backend cannot replay decodes from a graph (its decode path
        reads per-step values on the host, e.g. to size gathers and masks)."""
        return None

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        ...


_REGISTRY: dict[str, type[AttentionBackend]] = {}


def register_backend(cls: type[AttentionBackend]) -> type[AttentionBackend]:
    _REGISTRY[cls.name] = cls
    return cls


def available_backends() -> list[str]:
    return sorted(_REGISTRY)


def default_backend_name(device: torch.device) -> str:
    """triton on CUDA when it can run there (see TritonAttention.check_supported), else torch; a
    fallback on CUDA is logged with its reason (e.g. the Triton version)."""
    if device.type == "cuda" and "triton" in _REGISTRY:
        try:
            _REGISTRY["triton"].check_supported(device)
            return "triton"
        except RuntimeError as e:
            log.warning("attention backend: torch, not triton: %s", e)
    return "torch"


def get_backend(name: str | None, device: torch.device) -> type[AttentionBackend]:
    """The named backend, which must run on device (RuntimeError otherwise); None: the default."""
    if name is None:
        return _REGISTRY[default_backend_name(device)]
    if name not in _REGISTRY:
        raise ValueError(f"unknown attention backend {name!r}; available: {available_backends()}")
    cls = _REGISTRY[name]
    try:
        cls.check_supported(device)
    except RuntimeError as e:
        raise RuntimeError(
            f"--attention-backend {name} cannot run: {e}. Pass --attention-backend torch, "
            "or leave it unset to use the device's default backend"
        ) from e
    return cls
