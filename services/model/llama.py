"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2) in plain torch over a paged KV cache.

Parameter names follow the Hugging Face checkpoints except two fused projections:
qkv_proj = cat(q_proj, k_proj, v_proj) and gate_up_proj = cat(gate_proj, up_proj) (rows).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.services.model.arch import ModelArchConfig, rope_inv_freq
from splitserve.services.model.attention.backend import AttentionBackend, AttentionMetadata


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Same arithmetic as transformers (float32 statistics), so greedy tokens match exactly.
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class RotaryEmbedding(nn.Module):
    """Neox-style (rotate-half) RoPE from a precomputed cos/sin table."""

    def __init__(self, config: ModelArchConfig, max_len: int) -> None:
        super().__init__()
        self.config, self.max_len = config, max_len
        self.register_buffer("cos", torch.empty(max_len, config.head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(max_len, config.head_dim), persistent=False)
        self.reset_table()

    def reset_table(self) -> None:
        """(Re)compute the table; needed after building the model on the meta device."""
        if self.cos.is_meta:
            return
        inv_freq = rope_inv_freq(self.config)
        freqs = torch.arange(self.max_len, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1).to(self.cos.device)  # [max_len, head_dim]
        self.cos.copy_(emb.cos())
        self.sin.copy_(emb.sin())

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for the step's tokens, [num_tokens, 1, head_dim]; once per forward."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    # q: [T, h, d], k: [T, kvh, d], cos/sin: [T, 1, d]
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Attention(nn.Module):
    def __init__(self, config: ModelArchConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        self.backend = backend

    def forward(self, x, rope, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = apply_rotary(q, k, *rope)
        out = self.backend.forward(q, k, v, kv_cache, meta)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelArchConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelArchConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, backend)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, rope, kv_cache, meta) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelArchConfig, backend: AttentionBackend, max_len: int) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary = RotaryEmbedding(config, max_len)
        self.layers = nn.ModuleList(DecoderLayer(config, backend) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share lm_head with the embedding when the config says so (again after to_empty)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[torch.Tensor],  # per layer [2, num_blocks, block_size, kvh, d]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden] before the final norm
        x = self.embed_tokens(input_ids)
        rope = self.rotary.lookup(positions, x.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(x, rope, kv_cache, meta)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, hidden] -> [n, vocab] float32 logits for the rows that sample."""
        return self.lm_head(self.norm(hidden)).float()
