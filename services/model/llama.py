"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2) in plain torch over a paged KV cache.

Parameter names follow the Hugging Face checkpoints except two fused projections:
qkv_proj = cat(q_proj, k_proj, v_proj) and gate_up_proj = cat(gate_proj, up_proj) (rows).

Tensor parallel (services/model/parallel.py): built for rank r of N, the model holds its shard (local heads,
its slice of the MLP and of the vocab) and all-reduces after o_proj, down_proj and the embedding, and
all-gathers the logits; at N = 1 (SINGLE) it is the plain model, with no collectives.

RMSNorm, RoPE and SiLU-and-mul run through the attention backend's `ops` (plain torch, or Triton
kernels on the triton backend). The residual stream is carried beside each layer's output rather than
added to it, so every norm after the first can fuse the add: layer(h, residual) -> (mlp_out, residual).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from splitserve.services.model.arch import ModelArchConfig, rope_inv_freq
from splitserve.services.model.attention.backend import (
    AttentionBackend,
    AttentionMetadata,
    ModelOps,
    apply_rotary,  # noqa: F401  (the torch RoPE, re-exported)
)
from splitserve.services.model.parallel import (
    SINGLE,
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    TensorParallel,
    VocabParallelEmbedding,
)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, ops: ModelOps) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps, self.ops = eps, ops

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(normalised stream, stream), the stream being x, or x + residual when one is given."""
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps), x
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """Neox-style (rotate-half) RoPE from a precomputed cos/sin table."""

    cos: torch.Tensor  # [max_len, head_dim] float32 buffers
    sin: torch.Tensor

    def __init__(self, config: ModelArchConfig, max_len: int) -> None:
        super().__init__()
        self.config, self.max_len = config, max_len
        self.register_buffer("cos", torch.empty(max_len, config.head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(max_len, config.head_dim), persistent=False)
        self.reset_table()

    def reset_table(self) -> None:
        """(Re)compute the float32 table on the buffers' device; needed after building the model on
        the meta device, and it undoes a cast of the model to another dtype (the table stays float32)."""
        if self.cos.is_meta:
            return
        inv_freq = rope_inv_freq(self.config)
        freqs = torch.arange(self.max_len, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1).to(self.cos.device)  # [max_len, head_dim] float32
        self.cos, self.sin = emb.cos(), emb.sin()  # replaces the buffers


class Attention(nn.Module):
    """Over this rank's heads: qkv_proj holds their rows (q | k | v of the local heads), o_proj the
    matching input columns, summed over ranks."""

    def __init__(self, config: ModelArchConfig, backend: AttentionBackend, tp: TensorParallel) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = tp.local_heads(config)
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = ColumnParallelLinear(config.hidden_size, self.q_size + 2 * self.kv_size, config.qkv_bias)
        self.o_proj = RowParallelLinear(self.q_size, config.hidden_size, tp)
        self.backend = backend

    def forward(self, x, rope, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = self.backend.ops.rotate(q, k, rope)
        out = self.backend.forward(q, k, v, kv_cache, meta)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class MLP(nn.Module):
    """Over this rank's slice of the intermediate size: gate_up_proj holds (local gate | local up)
    rows, down_proj the matching input columns, summed over ranks."""

    def __init__(self, config: ModelArchConfig, ops: ModelOps, tp: TensorParallel) -> None:
        super().__init__()
        inter = config.intermediate_size // tp.size
        self.gate_up_proj = ColumnParallelLinear(config.hidden_size, 2 * inter, bias=False)
        self.down_proj = RowParallelLinear(inter, config.hidden_size, tp)
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelArchConfig, backend: AttentionBackend, tp: TensorParallel) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, backend.ops)
        self.self_attn = Attention(config, backend, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, backend.ops)
        self.mlp = MLP(config, backend.ops, tp)

    def forward(self, h, residual, rope, kv_cache, meta) -> tuple[torch.Tensor, torch.Tensor]:
        """h: the previous layer's MLP output (the embedding in the first layer, residual None there);
        returns this layer's MLP output and the stream before it, not yet added up."""
        h, residual = self.input_layernorm(h, residual)
        h = self.self_attn(h, rope, kv_cache, meta)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    def __init__(
        self, config: ModelArchConfig, backend: AttentionBackend, max_len: int, tp: TensorParallel = SINGLE
    ) -> None:
        super().__init__()
        tp.check(config)
        _check_backend_heads(backend, tp.local_heads(config))
        self.config, self.tp = config, tp
        self.ops = backend.ops
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.rotary = RotaryEmbedding(config, max_len)
        self.layers = nn.ModuleList(DecoderLayer(config, backend, tp) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, backend.ops)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share lm_head with the embedding when the config says so (again after to_empty); under
        tensor parallelism both hold the same vocab rows, so they share this rank's shard."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[torch.Tensor],  # per layer [2, num_blocks, block_size, kvh, d]
        meta: AttentionMetadata,
        on_layer: Callable[[int], None] | None = None,  # on_layer(i) once layer i's KV is in kv_caches[i]
    ) -> torch.Tensor:  # [num_tokens, hidden] before the final norm
        h, residual = self.embed_tokens(input_ids), None
        rope = self.ops.rope_lookup(self.rotary.cos, self.rotary.sin, positions, h.dtype)
        for index, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            h, residual = layer(h, residual, rope, kv_cache, meta)
            if on_layer is not None:
                on_layer(index)
        return residual + h  # only the sampled rows go through the final norm (compute_logits)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, hidden] -> [n, vocab] float32 logits for the rows that sample (all of them, on every rank)."""
        normed, _ = self.norm(hidden)
        return self.lm_head(normed).float()


def _check_backend_heads(backend: AttentionBackend, local_heads: tuple[int, int]) -> None:
    """The backend attends over this rank's heads only; built for others it would misread the cache."""
    if (backend.num_heads, backend.num_kv_heads) != local_heads:
        raise ValueError(
            f"the attention backend is built for {backend.num_heads} query / {backend.num_kv_heads} KV heads, "
            f"this rank holds {local_heads[0]} / {local_heads[1]}: build it with tp.local_heads(arch)"
        )
