"""Architecture config for the Llama family, read from a HF config.json or GGUF metadata."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from splitserve.common.model_files import ModelLoadError

# HF architecture name -> whether q/k/v projections carry a bias.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": False,
    "MistralForCausalLM": False,
    "Qwen2ForCausalLM": True,
}


@dataclass(frozen=True, slots=True)
class RopeScaling:
    rope_type: str  # "default", "linear" or "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True, slots=True)
class ModelArchConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    # GGUF files of Llama 3.1+ carry per-frequency divisors instead of rope_scaling parameters.
    rope_freq_factors: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ModelLoadError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelArchConfig:
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ModelLoadError(
                f"unsupported architecture {archs or cfg.get('model_type')!r}; "
                f"splitserve supports {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        try:
            num_heads = cfg["num_attention_heads"]
            hidden = cfg["hidden_size"]
            rope = cfg.get("rope_parameters") or {}
            return cls(
                architecture=arch,
                vocab_size=cfg["vocab_size"],
                hidden_size=hidden,
                intermediate_size=cfg["intermediate_size"],
                num_layers=cfg["num_hidden_layers"],
                num_heads=num_heads,
                num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
                head_dim=cfg.get("head_dim") or hidden // num_heads,
                rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
                rope_theta=float(cfg.get("rope_theta") or rope.get("rope_theta", 10000.0)),
                rope_scaling=_parse_rope_scaling(cfg.get("rope_scaling") or rope),
                max_position_embeddings=cfg.get("max_position_embeddings", 2048),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                qkv_bias=SUPPORTED_ARCHITECTURES[arch] or bool(cfg.get("attention_bias", False)),
            )
        except KeyError as e:
            raise ModelLoadError(f"config.json lacks the required field {e.args[0]!r}") from None


def _parse_rope_scaling(raw: dict[str, Any] | None) -> RopeScaling:
    if not raw:
        return RopeScaling("default")
    rope_type = raw.get("rope_type") or raw.get("type") or "default"
    if rope_type == "default":
        return RopeScaling("default")
    if rope_type not in ("linear", "llama3"):
        raise ModelLoadError(
            f"unsupported rope_scaling type {rope_type!r}; splitserve supports default, linear and llama3"
        )
    return RopeScaling(
        rope_type=rope_type,
        factor=float(raw.get("factor", 1.0)),
        low_freq_factor=float(raw.get("low_freq_factor", 1.0)),
        high_freq_factor=float(raw.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(raw.get("original_max_position_embeddings", 8192)),
    )


def rope_inv_freq(config: ModelArchConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2], float32, computed as transformers does."""
    dim = config.head_dim
    exponent = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float) / dim
    inv_freq = 1.0 / (config.rope_theta**exponent)
    scaling = config.rope_scaling
    if config.rope_freq_factors is not None:
        return inv_freq / torch.tensor(config.rope_freq_factors, dtype=torch.float32)
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "llama3":
        return _llama3_scale(inv_freq, scaling)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    old_len = s.original_max_position_embeddings
    low_freq_wavelen = old_len / s.low_freq_factor
    high_freq_wavelen = old_len / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)
