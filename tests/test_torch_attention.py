"""The torch paged-attention backend against a dense causal reference."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from splitserve.model.attention.backend import AttentionMetadata
from splitserve.model.attention.torch_backend import TorchAttention, length_groups

pytestmark = pytest.mark.unit


def _dense_reference(q, k_all, v_all, query_len):
    """q [ql, h, d], k/v [L, kvh, d] of one sequence; causal with the queries at the end."""
    h, kvh = q.shape[1], k_all.shape[1]
    k = k_all.repeat_interleave(h // kvh, dim=1).transpose(0, 1)
    v = v_all.repeat_interleave(h // kvh, dim=1).transpose(0, 1)
    seq_len = k_all.shape[0]
    mask = torch.arange(seq_len)[None, :] <= torch.arange(seq_len - query_len, seq_len)[:, None]
    return F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask).transpose(0, 1)


def test_paged_attention_matches_dense_with_length_groups():
    torch.manual_seed(0)
    rng = random.Random(0)
    h, kvh, d, bs, num_blocks = 6, 2, 16, 4, 400
    backend = TorchAttention(h, kvh, d, bs)
    kv_cache = torch.zeros(2, num_blocks, bs, kvh, d)
    seq_lens = [rng.choice([1, 3, 9, 40, 41, 90, 150]) for _ in range(24)] + [37, 12]  # 24 decodes, 2 prefills
    query_lens = [1] * 24 + [5, 12]
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables, history, slots = [], [], []
    for seq_len, ql in zip(seq_lens, query_lens):
        blocks = [free.pop() for _ in range(-(-seq_len // bs))]
        tables.append(blocks)
        k, v = torch.randn(seq_len, kvh, d), torch.randn(seq_len, kvh, d)
        history.append((k, v))
        for p in range(seq_len - ql):  # the cached prefix is already in the cache
            kv_cache[0, blocks[p // bs], p % bs], kv_cache[1, blocks[p // bs], p % bs] = k[p], v[p]
        slots += [blocks[p // bs] * bs + p % bs for p in range(seq_len - ql, seq_len)]
    width = max(map(len, tables))
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=torch.tensor([0] + list(torch.tensor(query_lens).cumsum(0)), dtype=torch.int32),
        num_decodes=24,
        max_seq_len=max(seq_lens),
        seq_lens_cpu=seq_lens,
        query_lens_cpu=query_lens,
    )
    q = torch.randn(sum(query_lens), h, d)
    new_k = torch.cat([k[-ql:] for (k, _), ql in zip(history, query_lens)])
    new_v = torch.cat([v[-ql:] for (_, v), ql in zip(history, query_lens)])
    assert len(length_groups(seq_lens[:24])) > 1  # the grouped decode path is exercised
    out = backend.forward(q, new_k, new_v, kv_cache, meta)
    start = 0
    for (k, v), ql in zip(history, query_lens):
        torch.testing.assert_close(
            out[start : start + ql], _dense_reference(q[start : start + ql], k, v, ql), rtol=1e-5, atol=1e-5
        )
        start += ql


def test_length_groups():
    assert length_groups([5, 6, 7]) == [[0, 1, 2]]  # one group keeps batch order
    lens = [100] * 8 + [10] * 8
    groups = length_groups(lens)
    assert sorted(i for g in groups for i in g) == list(range(16))
    assert [sorted(g) for g in groups] == [list(range(8, 16)), list(range(8))]
