"""Plain-torch paged attention: the CPU path and the reference for the Triton kernels."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from splitserve.model.attention.backend import (
    AttentionBackend,
    AttentionMetadata,
    register_backend,
)


def store_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write new tokens' K and V ([num_tokens, num_kv_heads, head_dim]) into their cache slots."""
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, num_kv_heads, head_dim)
    flat[0].index_copy_(0, slot_mapping, k)
    flat[1].index_copy_(0, slot_mapping, v)


def gather_kv(kv_cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """K and V of whole blocks: [2, num_seqs, num_blocks * block_size, num_kv_heads, head_dim]."""
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    num_seqs, blocks_per_seq = block_table.shape
    # index_select over whole blocks copies contiguous rows; kv_cache[:, block_table] is ~20x slower.
    rows = kv_cache.view(2, num_blocks, -1).index_select(1, block_table.flatten())
    return rows.view(2, num_seqs, blocks_per_seq * block_size, num_kv_heads, head_dim)


def length_groups(seq_lens: list[int], ratio: float = 1.5, min_size: int = 8) -> list[list[int]]:
    """Indices of decode sequences grouped by similar length (sorted), each group at least
    min_size long unless it is the last; a group closes when lengths grow past ratio x its first."""
    order = sorted(range(len(seq_lens)), key=seq_lens.__getitem__)
    groups: list[list[int]] = [[]]
    for i in order:
        current = groups[-1]
        if len(current) >= min_size and seq_lens[i] > ratio * seq_lens[current[0]]:
            groups.append([])
        groups[-1].append(i)
    if len(groups) == 1:
        return [list(range(len(seq_lens)))]  # keep the batch order: no gather/scatter needed
    return groups


@register_backend
class TorchAttention(AttentionBackend):
    name = "torch"

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        store_kv(k, v, kv_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            out[:nd] = self._decode(q[:nd], kv_cache, meta)
        start = nd
        for i in range(nd, meta.num_seqs):
            end = start + meta.query_lens_cpu[i]
            out[start:end] = self._prefill(q[start:end], kv_cache, meta, i)
            start = end
        return out

    def _decode(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        lens = meta.seq_lens_cpu[: meta.num_decodes]
        groups = length_groups(lens)
        if len(groups) == 1:
            num_seqs = len(lens)
            return self._decode_group(q, kv_cache, meta.block_tables[:num_seqs], meta.seq_lens[:num_seqs], max(lens))
        out = torch.empty_like(q)
        for group in groups:  # similar lengths together: less padding to gather and attend over
            idx = torch.tensor(group, device=q.device)
            out[idx] = self._decode_group(
                q[idx], kv_cache, meta.block_tables[idx], meta.seq_lens[idx], max(lens[i] for i in group)
            )
        return out

    def _decode_group(self, q, kv_cache, block_tables, seq_lens, max_len: int) -> torch.Tensor:
        bs = self.block_size
        num_blocks = -(-max_len // bs)
        kv = gather_kv(kv_cache, block_tables[:, :num_blocks])
        keys = kv[0].transpose(1, 2)  # [n, kvh, L, d]
        values = kv[1].transpose(1, 2)
        positions = torch.arange(num_blocks * bs, device=q.device)
        mask = positions[None, :] < seq_lens[:, None]  # [n, L]
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2),
            keys,
            values,
            attn_mask=mask[:, None, None, :],
            scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )  # [n, h, 1, d]
        return out.squeeze(2)

    def _prefill(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, i: int) -> torch.Tensor:
        seq_len, query_len = meta.seq_lens_cpu[i], meta.query_lens_cpu[i]
        num_blocks = -(-seq_len // self.block_size)
        kv = gather_kv(kv_cache, meta.block_tables[i : i + 1, :num_blocks])[:, 0, :seq_len]
        keys, values = kv[0].transpose(0, 1), kv[1].transpose(0, 1)  # [kvh, L, d]
        gqa = self.num_heads != self.num_kv_heads
        qt = q.transpose(0, 1)  # [h, ql, d]
        if seq_len == query_len:
            out = F.scaled_dot_product_attention(qt, keys, values, is_causal=True, scale=self.scale, enable_gqa=gqa)
        else:  # a cached prefix: query j sits at position seq_len - query_len + j
            rows = torch.arange(seq_len - query_len, seq_len, device=q.device)[:, None]
            mask = torch.arange(seq_len, device=q.device)[None, :] <= rows
            out = F.scaled_dot_product_attention(qt, keys, values, attn_mask=mask, scale=self.scale, enable_gqa=gqa)
        return out.transpose(0, 1)
