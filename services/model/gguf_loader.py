"""Load a GGUF file: architecture from metadata, weights dequantized with the `gguf` package and
renamed to the Hugging Face layout, tokenizer rebuilt from the embedded vocab and merges."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from splitserve.common.gguf_tokenizer import load_gguf_tokenizer
from splitserve.common.model_files import gguf_field, open_gguf
from splitserve.common.tokenizer import Tokenizer
from splitserve.services.model.arch import ModelArchConfig, ModelLoadError, RopeScaling

# GGUF general.architecture -> (HF architecture, llama.cpp permuted the Q/K rows)
GGUF_ARCHITECTURES = {"llama": ("LlamaForCausalLM", True), "qwen2": ("Qwen2ForCausalLM", False)}

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


class GGUFModel:
    def __init__(self, path: Path) -> None:
        self.reader = open_gguf(path)
        self.path = path
        self.gguf_arch = self._get("general.architecture")
        if self.gguf_arch not in GGUF_ARCHITECTURES:
            raise ModelLoadError(
                f"unsupported GGUF architecture {self.gguf_arch!r}; splitserve supports {sorted(GGUF_ARCHITECTURES)}"
            )
        self.arch = self._arch_config()

    def _get(self, key: str, default=None):
        return gguf_field(self.reader, key, default)

    def _arch_config(self) -> ModelArchConfig:
        a = self.gguf_arch
        hf_arch, _ = GGUF_ARCHITECTURES[a]
        hidden = self._get(f"{a}.embedding_length")
        num_heads = self._get(f"{a}.attention.head_count")
        tensor_names = {t.name for t in self.reader.tensors}
        factors = None
        if "rope_freqs.weight" in tensor_names:
            t = next(t for t in self.reader.tensors if t.name == "rope_freqs.weight")
            factors = tuple(float(x) for x in np.asarray(t.data).reshape(-1))
        return ModelArchConfig(
            architecture=hf_arch,
            vocab_size=self._get(f"{a}.vocab_size") or len(self._get("tokenizer.ggml.tokens")),
            hidden_size=hidden,
            intermediate_size=self._get(f"{a}.feed_forward_length"),
            num_layers=self._get(f"{a}.block_count"),
            num_heads=num_heads,
            num_kv_heads=self._get(f"{a}.attention.head_count_kv") or num_heads,
            head_dim=self._get(f"{a}.rope.dimension_count") or hidden // num_heads,
            rms_norm_eps=float(self._get(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(self._get(f"{a}.rope.freq_base", 10000.0)),
            rope_scaling=self._rope_scaling(),
            max_position_embeddings=self._get(f"{a}.context_length", 2048),
            tie_word_embeddings="output.weight" not in tensor_names,
            qkv_bias="blk.0.attn_q.bias" in tensor_names,
            rope_freq_factors=factors,
        )

    def _rope_scaling(self) -> RopeScaling:
        kind = self._get(f"{self.gguf_arch}.rope.scaling.type", "none")
        if kind in ("none", None):
            return RopeScaling("default")
        if kind != "linear":
            raise ModelLoadError(f"unsupported GGUF rope scaling {kind!r}")
        return RopeScaling("linear", factor=float(self._get(f"{self.gguf_arch}.rope.scaling.factor", 1.0)))

    def hf_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, float32 tensor) for every weight, with llama.cpp's Q/K row permutation undone."""
        from gguf.quants import dequantize

        _, permuted = GGUF_ARCHITECTURES[self.gguf_arch]
        for t in self.reader.tensors:
            name = _hf_name(t.name)
            if name is None:
                continue
            array = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
            shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dims innermost first
            tensor = torch.from_numpy(np.array(array.reshape(shape), copy=True))
            if permuted and name.endswith(("q_proj.weight", "k_proj.weight")):
                heads = self.arch.num_heads if "q_proj" in name else self.arch.num_kv_heads
                tensor = _unpermute(tensor, heads)
            yield name, tensor

    def tokenizer(self) -> Tokenizer:
        return load_gguf_tokenizer(self.path, self.reader)


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if parts[0] != "blk" or len(parts) != 4 or parts[2] not in _LAYER_NAMES:
        return None  # rope_freqs and other non-weights
    return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"


def _unpermute(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head interleaving of rotary halves in Q/K rows ([out, ...])."""
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
