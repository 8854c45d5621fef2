"""Plain-torch paged attention: the CPU path and the reference for the Triton kernels.

Every layer of a step attends with the same metadata, so the first layer builds a plan (_StepPlan)
that the others reuse: the decodes' length groups with their block ids and padding masks, and each
prompt chunk's context blocks and mask (masks additive, in the query's dtype: what SDPA would turn a
boolean mask into on every call). Then, per layer, after storing the new K/V:
- a group of decodes gathers its sequences' whole blocks and attends with a padding mask;
- a prompt chunk with nothing cached before it attends to its own new K/V (no gather), causal;
- a chunk after cached tokens gathers its context and attends with the plan's [query, context] mask
  (torch's is_causal aligns the diagonal top-left, wrong for queries at the end of the context).
On CPU the decodes instead attend over contiguous copies of their K/V kept from step to step (the
decode mirror: attention/decode_mirror.py), written one token per step, when the step's sequences are
known and the copies fit their memory budget.
SDPA always gets 4-D [batch, heads, tokens, head_dim] inputs: on CPU only those reach the flash
kernel; 3-D ones fall back to the math path, which materialises float32 scores (~5x slower at 2,048
tokens).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from splitserve.services.model.attention.backend import (
    AttentionBackend,
    AttentionMetadata,
    register_backend,
)
from splitserve.services.model.attention.cache_ops import additive_mask, gather_kv, store_kv
from splitserve.services.model.attention.decode_mirror import DecodeMirror, MirrorStep


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


class _DecodeGroup(NamedTuple):
    rows: slice | torch.Tensor  # its sequences' rows in the batch (a slice: all decodes, in order)
    block_ids: torch.Tensor  # [num_seqs * blocks_per_seq]: each sequence's first blocks_per_seq blocks
    num_seqs: int
    mask: torch.Tensor | None  # [num_seqs, 1, 1, blocks_per_seq * block_size] 0 / -inf; None: no padding


class _Chunk(NamedTuple):
    tokens: slice  # its query tokens in the batch
    seq_len: int  # context length, its own tokens included
    block_ids: torch.Tensor | None  # [ceil(seq_len / block_size)]; None: nothing cached before it
    mask: torch.Tensor | None  # [query_len, seq_len] 0 / -inf: query j sits at seq_len - query_len + j


@dataclass(frozen=True, slots=True)
class _StepPlan:
    """What every layer of one step shares; built from (and valid for) one AttentionMetadata."""

    meta: AttentionMetadata
    mirror: MirrorStep | None  # the decodes attend over their mirrored K/V (else through decodes)
    decodes: list[_DecodeGroup]
    chunks: list[_Chunk]

    @classmethod
    def build(
        cls, meta: AttentionMetadata, block_size: int, dtype: torch.dtype, mirror: MirrorStep | None
    ) -> _StepPlan:
        nd = meta.num_decodes
        decodes = _decode_groups(meta, block_size, dtype) if nd and mirror is None else []
        chunks, start = [], nd
        for i in range(nd, meta.num_seqs):
            end = start + meta.query_lens_cpu[i]
            chunks.append(_chunk(meta, i, slice(start, end), block_size, dtype))
            start = end
        return cls(meta, mirror, decodes, chunks)


def _decode_groups(meta: AttentionMetadata, block_size: int, dtype: torch.dtype) -> list[_DecodeGroup]:
    lens = meta.seq_lens_cpu[: meta.num_decodes]
    groups = length_groups(lens)
    device = meta.block_tables.device
    out = []
    for group in groups:  # similar lengths together: less padding to gather and attend over
        rows = slice(0, len(lens)) if len(groups) == 1 else torch.tensor(group, device=device)
        group_lens = [lens[i] for i in group]
        num_blocks = -(-max(group_lens) // block_size)
        block_ids = meta.block_tables[rows, :num_blocks].flatten()
        mask = None
        if min(group_lens) < num_blocks * block_size:
            positions = torch.arange(num_blocks * block_size, device=device)
            mask = additive_mask(positions[None, :] < meta.seq_lens[rows, None], dtype)[:, None, None, :]
        out.append(_DecodeGroup(rows, block_ids, len(group), mask))
    return out


def _chunk(meta: AttentionMetadata, i: int, tokens: slice, block_size: int, dtype: torch.dtype) -> _Chunk:
    seq_len, query_len = meta.seq_lens_cpu[i], meta.query_lens_cpu[i]
    if seq_len == query_len:
        return _Chunk(tokens, seq_len, None, None)
    device = meta.block_tables.device
    block_ids = meta.block_tables[i, : -(-seq_len // block_size)]
    rows = torch.arange(seq_len - query_len, seq_len, device=device)[:, None]
    mask = additive_mask(torch.arange(seq_len, device=device)[None, :] <= rows, dtype)
    return _Chunk(tokens, seq_len, block_ids, mask)


@register_backend
class TorchAttention(AttentionBackend):
    name = "torch"

    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, decode_mirror_bytes: int | None = None
    ) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, block_size, decode_mirror_bytes)
        self.gqa = num_heads != num_kv_heads
        self._plan: _StepPlan | None = None  # the last step's (held: a new step's meta is a new object)
        self._mirror = (
            None if decode_mirror_bytes == 0 else DecodeMirror(num_kv_heads, head_dim, block_size, decode_mirror_bytes)
        )

    def forward(self, q, k, v, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        store_kv(k, v, kv_cache, meta.slot_mapping)
        plan = self._plan_for(meta, kv_cache)
        out = torch.empty_like(q)
        if plan.mirror is not None:
            nd = meta.num_decodes
            out[:nd] = self._decode_mirrored(q[:nd], k[:nd], v[:nd], kv_cache, plan.mirror)
        for group in plan.decodes:
            out[group.rows] = self._decode(q[group.rows], kv_cache, group)
        for chunk in plan.chunks:
            out[chunk.tokens] = self._prefill(q[chunk.tokens], k[chunk.tokens], v[chunk.tokens], kv_cache, chunk)
        return out

    def _plan_for(self, meta: AttentionMetadata, kv_cache: torch.Tensor) -> _StepPlan:
        if self._plan is None or self._plan.meta is not meta:
            mirror = None
            if self._mirror is not None and kv_cache.device.type == "cpu":  # on CUDA memory is the KV cache's
                mirror = self._mirror.plan(meta, kv_cache.nbytes, kv_cache.dtype)
            self._plan = _StepPlan.build(meta, self.block_size, kv_cache.dtype, mirror)
        return self._plan

    def _decode_mirrored(self, q, k, v, kv_cache: torch.Tensor, step: MirrorStep) -> torch.Tensor:
        # q: [n, h, d]; k, v: [n, kvh, d], the decodes' new tokens -> [n, h, d]
        assert self._mirror is not None  # a step has a MirrorStep only from it
        keys, values = self._mirror.update(k, v, kv_cache, step)  # [n, kvh, width, d], slot order
        q = (q if step.row_of_slot is None else q[step.row_of_slot]).unsqueeze(2)  # [n, h, 1, d], slot order
        out = torch.empty_like(q)
        for r in step.ranges:  # slots of similar lengths, each range at its own width
            out[r.start : r.stop] = F.scaled_dot_product_attention(
                q[r.start : r.stop],
                keys[r.start : r.stop, :, : r.width],
                values[r.start : r.stop, :, : r.width],
                attn_mask=r.mask,
                scale=self.scale,
                enable_gqa=self.gqa,
            )
        out = out.squeeze(2)
        return out if step.slot_of_row is None else out[step.slot_of_row]

    def _decode(self, q: torch.Tensor, kv_cache: torch.Tensor, group: _DecodeGroup) -> torch.Tensor:
        # q: [n, h, d] -> [n, h, d]
        kv = gather_kv(kv_cache, group.block_ids)
        kv = kv.view(2, group.num_seqs, -1, self.num_kv_heads, self.head_dim).transpose(2, 3)  # [2, n, kvh, L, d]
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2), kv[0], kv[1], attn_mask=group.mask, scale=self.scale, enable_gqa=self.gqa
        )  # [n, h, 1, d]
        return out.squeeze(2)

    def _prefill(self, q, k, v, kv_cache: torch.Tensor, chunk: _Chunk) -> torch.Tensor:
        # q: [ql, h, d]; k, v: [ql, kvh, d], this chunk's new tokens -> [ql, h, d]
        if chunk.block_ids is not None:  # cached tokens come first: attend to the whole context
            kv = gather_kv(kv_cache, chunk.block_ids)[:, : chunk.seq_len]
            k, v = kv[0], kv[1]
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),  # [1, h, ql, d]
            k.transpose(0, 1).unsqueeze(0),  # [1, kvh, L, d]
            v.transpose(0, 1).unsqueeze(0),
            attn_mask=chunk.mask,
            is_causal=chunk.mask is None,
            scale=self.scale,
            enable_gqa=self.gqa,
        )  # [1, h, ql, d]
        return out[0].transpose(0, 1)
