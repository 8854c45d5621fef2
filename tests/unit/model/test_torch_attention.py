"""The torch paged-attention backend against a dense causal reference."""

from __future__ import annotations

import random
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from splitserve.services.model.attention.backend import AttentionMetadata
from splitserve.services.model.attention.torch_backend import TorchAttention, length_groups

H, KVH, D, BS, NUM_BLOCKS = 6, 2, 16, 4, 400


def _dense_reference(q, k_all, v_all, query_len):
    """q [ql, h, d], k/v [L, kvh, d] of one sequence; causal with the queries at the end."""
    h, kvh = q.shape[1], k_all.shape[1]
    k = k_all.repeat_interleave(h // kvh, dim=1).transpose(0, 1)
    v = v_all.repeat_interleave(h // kvh, dim=1).transpose(0, 1)
    seq_len = k_all.shape[0]
    mask = torch.arange(seq_len)[None, :] <= torch.arange(seq_len - query_len, seq_len)[:, None]
    return F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask).transpose(0, 1)


class Layer(NamedTuple):
    """One layer's step: its cache (the cached prefixes written), new K/V, queries, each sequence's K/V."""

    kv_cache: torch.Tensor
    q: torch.Tensor
    new_k: torch.Tensor
    new_v: torch.Tensor
    history: list[tuple[torch.Tensor, torch.Tensor]]


def _meta(seq_lens: list[int], query_lens: list[int], rng: random.Random) -> AttentionMetadata:
    """Every sequence on shuffled blocks of its own."""
    free = list(range(NUM_BLOCKS))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-n // BS))] for n in seq_lens]
    slots = [t[p // BS] * BS + p % BS for t, n, ql in zip(tables, seq_lens, query_lens) for p in range(n - ql, n)]
    width = max(map(len, tables))
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables]),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=torch.tensor([0] + list(torch.tensor(query_lens).cumsum(0)), dtype=torch.int32),
        num_decodes=sum(1 for ql in query_lens if ql == 1),
        max_seq_len=max(seq_lens),
        seq_lens_cpu=seq_lens,
        query_lens_cpu=query_lens,
    )


def _layer(meta: AttentionMetadata) -> Layer:
    kv_cache = torch.zeros(2, NUM_BLOCKS, BS, KVH, D)
    history = []
    for row, seq_len, ql in zip(meta.block_tables.tolist(), meta.seq_lens_cpu, meta.query_lens_cpu):
        k, v = torch.randn(seq_len, KVH, D), torch.randn(seq_len, KVH, D)
        history.append((k, v))
        for p in range(seq_len - ql):  # the cached prefix is already in the cache
            kv_cache[0, row[p // BS], p % BS], kv_cache[1, row[p // BS], p % BS] = k[p], v[p]
    new_k = torch.cat([k[-ql:] for (k, _), ql in zip(history, meta.query_lens_cpu)])
    new_v = torch.cat([v[-ql:] for (_, v), ql in zip(history, meta.query_lens_cpu)])
    return Layer(kv_cache, torch.randn(sum(meta.query_lens_cpu), H, D), new_k, new_v, history)


def _check(out: torch.Tensor, layer: Layer, meta: AttentionMetadata) -> None:
    start = 0
    for (k, v), ql in zip(layer.history, meta.query_lens_cpu):
        expected = _dense_reference(layer.q[start : start + ql], k, v, ql)
        torch.testing.assert_close(out[start : start + ql], expected, rtol=1e-5, atol=1e-5)
        start += ql


def _forward(backend: TorchAttention, layer: Layer, meta: AttentionMetadata) -> torch.Tensor:
    return backend.forward(layer.q, layer.new_k, layer.new_v, layer.kv_cache, meta)


def test_paged_attention_matches_dense_with_length_groups():
    torch.manual_seed(0)
    rng = random.Random(0)
    seq_lens = [rng.choice([1, 3, 9, 40, 41, 90, 150]) for _ in range(24)] + [37, 12]  # 24 decodes, 2 prefills
    meta = _meta(seq_lens, [1] * 24 + [5, 12], rng)  # a chunk after a cached prefix, a whole prompt
    assert len(length_groups(seq_lens[:24])) > 1  # the grouped decode path is exercised
    layer = _layer(meta)
    _check(_forward(TorchAttention(H, KVH, D, BS), layer, meta), layer, meta)


def test_layers_of_a_step_share_one_plan():
    """Every layer of a step reuses the first layer's plan on its own cache; a new step's metadata
    gets a new plan."""
    torch.manual_seed(1)
    rng = random.Random(1)
    backend = TorchAttention(H, KVH, D, BS)
    for seq_lens, query_lens in (([30, 7, 64, 100], [1, 1, 64, 20]), ([9, 250], [1, 3])):
        meta = _meta(seq_lens, query_lens, rng)
        layers = [_layer(meta) for _ in range(3)]
        outs = [_forward(backend, layer, meta) for layer in layers]
        for out, layer in zip(outs, layers):
            _check(out, layer, meta)
        assert backend._plan is not None and backend._plan.meta is meta


def test_prefill_reaches_the_flash_kernel_on_cpu():
    """3-D SDPA inputs fall back to the math path (float32 scores materialised, ~5x slower at 2,048
    tokens): whole prompts and chunks after a cached prefix must both reach the flash kernel."""
    torch.manual_seed(2)
    meta = _meta([64, 96], [64, 32], random.Random(2))
    layer = _layer(meta)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = _forward(TorchAttention(H, KVH, D, BS), layer, meta)
    ops = {event.key for event in prof.key_averages()}
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in ops
    assert "aten::_scaled_dot_product_attention_math" not in ops
    _check(out, layer, meta)


def test_length_groups():
    assert length_groups([5, 6, 7]) == [[0, 1, 2]]  # one group keeps batch order
    lens = [100] * 8 + [10] * 8
    groups = length_groups(lens)
    assert sorted(i for g in groups for i in g) == list(range(16))
    assert [sorted(g) for g in groups] == [list(range(8, 16)), list(range(8))]
