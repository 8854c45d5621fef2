"""Every Triton kernel against its plain-torch `*_ref` at small shapes: under the interpreter on CPU
(TRITON_INTERPRET=1, set in tests/conftest.py), compiled on CUDA."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

pytest.importorskip("triton")

from splitserve import kernels as K  # noqa: E402  (after the skip)
from splitserve.kernels import _common  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # on CPU, tests/conftest.py sets TRITON_INTERPRET=1
if DEVICE == "cpu" and not _common.INTERPRETED:
    raise RuntimeError("Triton kernel tests on CPU need TRITON_INTERPRET=1 set before triton is imported")

from splitserve.services.model.arch import ModelArchConfig, RopeScaling, rope_inv_freq  # noqa: E402

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Kernels and references both compute in float32; the outputs differ by rounding of the result (and
# on the GPU by fp16/bf16 tl.dot operands): about one ulp of the dtype.
TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.float16: dict(rtol=2e-3, atol=2e-3),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2),
}
NUM_KV_HEADS = 2
# (dtype, group, head_dim, block_size) of the attention tests. Compiled on CUDA: every combination. Under
# the interpreter (about 0.5 s a case) every shape with one dtype in turn, so each dtype still meets each
# group, head_dim and block size (the unit run takes the first; `make test` all: grid()).
ATTENTION_SHAPES = list(itertools.product([1, 3, 8], [64, 128], [8, 16]))
ATTENTION_CASES = (
    [(dtype, *shape) for dtype in DTYPES for shape in ATTENTION_SHAPES]
    if DEVICE == "cuda"
    else [(DTYPES[i % len(DTYPES)], *shape) for i, shape in enumerate(ATTENTION_SHAPES)]
)


def grid(cases) -> list:
    """A kernel's cases: the first in the unit run, the rest in `make test` (marker kernels; the
    interpreter takes about 0.5 s a case)."""
    cases = list(cases)
    return cases[:1] + [
        pytest.param(*c if isinstance(c, tuple) else (c,), marks=pytest.mark.kernels) for c in cases[1:]
    ]


def _case_id(value) -> str | None:
    return str(value).removeprefix("torch.") if isinstance(value, torch.dtype) else None


@pytest.fixture(autouse=True)
def _on_device():
    with torch.device(DEVICE):  # the default device for every tensor the test makes
        yield


def _paged_context(seq_lens: list[int], block_size: int, head_dim: int, dtype, seed: int = 0):
    """A cache holding each sequence's whole context in shuffled blocks; returns (kv_cache,
    block_tables [num_seqs, max_blocks] padded with 0)."""
    rng = random.Random(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(n)] for n in blocks_per_seq]
    width = max(blocks_per_seq)
    kv_cache = torch.randn(2, num_blocks, block_size, NUM_KV_HEADS, head_dim).to(dtype)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64)
    return kv_cache, block_tables


@pytest.mark.parametrize(("dtype", "block_size"), grid(itertools.product(DTYPES, [8, 16])), ids=_case_id)
def test_store_kv(dtype, block_size):
    torch.manual_seed(0)
    head_dim, num_blocks, num_tokens = 64, 6, 13
    kv_cache = torch.randn(2, num_blocks, block_size, NUM_KV_HEADS, head_dim).to(dtype)
    qkv = torch.randn(num_tokens, 3 * NUM_KV_HEADS * head_dim).to(dtype)  # strided views, as in the model
    k = qkv[:, : NUM_KV_HEADS * head_dim].view(num_tokens, NUM_KV_HEADS, head_dim)
    v = qkv[:, NUM_KV_HEADS * head_dim : 2 * NUM_KV_HEADS * head_dim].view(num_tokens, NUM_KV_HEADS, head_dim)
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    expected = kv_cache.clone()
    K.store_kv_ref(k, v, expected, slots)
    K.store_kv(k, v, kv_cache, slots.to(torch.int32))
    assert torch.equal(kv_cache, expected)


def test_store_kv_skips_padding_slots():
    """PAD_SLOT_ID rows (a CUDA-graph decode step's padding) store nothing, wherever they sit."""
    from splitserve.kernels.store_kv import PAD_SLOT_ID
    from splitserve.services.model.attention.backend import PAD_SLOT_ID as MODEL_PAD_SLOT_ID

    assert PAD_SLOT_ID == MODEL_PAD_SLOT_ID
    torch.manual_seed(0)
    # Layers in one tensor, as the engine's cache: a negative slot of layer 1 would land in layer 0's V.
    caches = torch.randn(2, 2, 4, 8, NUM_KV_HEADS, 16)
    k, v = torch.randn(5, NUM_KV_HEADS, 16), torch.randn(5, NUM_KV_HEADS, 16)
    slots = torch.tensor([3, PAD_SLOT_ID, 17, PAD_SLOT_ID, PAD_SLOT_ID])
    expected = caches.clone()
    K.store_kv_ref(k, v, expected[1], slots)
    K.store_kv(k, v, caches[1], slots)
    assert torch.equal(caches, expected)
    assert torch.equal(caches[1, 0].view(-1, NUM_KV_HEADS, 16)[[3, 17]], k[[0, 2]])  # the real rows did store


# Length 1, one full block, partial last blocks, and more than one 64-token tile.
DECODE_LENS = [1, 16, 37, 130, 9]


@pytest.mark.parametrize(("dtype", "group", "head_dim", "block_size"), grid(ATTENTION_CASES), ids=_case_id)
def test_paged_decode_attention(dtype, group, head_dim, block_size):
    torch.manual_seed(1)
    kv_cache, block_tables = _paged_context(DECODE_LENS, block_size, head_dim, dtype)
    seq_lens = torch.tensor(DECODE_LENS, dtype=torch.int32)
    q = torch.randn(len(DECODE_LENS), NUM_KV_HEADS * group, head_dim).to(dtype)
    scale = head_dim**-0.5
    expected = K.paged_decode_attention_ref(q, kv_cache, block_tables, seq_lens, scale)
    # One split, and split-K with 3 splits (the shortest sequences leave some splits empty).
    for num_splits in (1, 3):
        out = K.paged_decode_attention(q, kv_cache, block_tables, seq_lens, scale, num_splits=num_splits)
        torch.testing.assert_close(out, expected, **TOL[dtype])


# (cached prefix length, new tokens): empty and non-empty prefixes, a one-token query, queries that
# span several query blocks and KV tiles, prefixes ending mid-block and on a block boundary.
PREFILL_SEQS = [(0, 1), (0, 37), (21, 5), (64, 70), (3, 1)]


@pytest.mark.parametrize(("dtype", "group", "head_dim", "block_size"), grid(ATTENTION_CASES), ids=_case_id)
def test_paged_prefill_attention(dtype, group, head_dim, block_size):
    torch.manual_seed(2)
    seq_lens_list = [p + n for p, n in PREFILL_SEQS]
    kv_cache, block_tables = _paged_context(seq_lens_list, block_size, head_dim, dtype)
    query_lens = [n for _, n in PREFILL_SEQS]
    offset = 4  # the prefill part of a batch whose 4 decode tokens come first
    query_start_loc = torch.tensor(
        [offset] + [offset + sum(query_lens[: i + 1]) for i in range(len(query_lens))], dtype=torch.int32
    )
    seq_lens = torch.tensor(seq_lens_list, dtype=torch.int32)
    q = torch.randn(sum(query_lens), NUM_KV_HEADS * group, head_dim).to(dtype)
    scale = head_dim**-0.5
    out = K.paged_prefill_attention(
        q, kv_cache, block_tables, seq_lens, query_start_loc, scale, max_query_len=max(query_lens)
    )
    expected = K.paged_prefill_attention_ref(q, kv_cache, block_tables, seq_lens, query_start_loc, scale)
    torch.testing.assert_close(out, expected, **TOL[dtype])


def test_attention_wrappers_reject_bad_inputs():
    kv_cache, block_tables = _paged_context([5, 9], 8, 64, torch.float32)
    seq_lens = torch.tensor([5, 9], dtype=torch.int32)
    q = torch.randn(2, 4, 64)
    with pytest.raises(ValueError, match="dtype"):
        K.paged_decode_attention(q.half(), kv_cache, block_tables, seq_lens, 0.125)
    with pytest.raises(ValueError, match="seq_lens must have dtype"):
        K.paged_decode_attention(q, kv_cache, block_tables, seq_lens.float(), 0.125)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        K.paged_decode_attention(torch.randn(2, 3, 64), kv_cache, block_tables, seq_lens, 0.125)
    with pytest.raises(ValueError, match="head_dim"):
        K.paged_decode_attention(torch.randn(2, 4, 32), kv_cache, block_tables, seq_lens, 0.125)
    with pytest.raises(ValueError, match="contiguous in its last dimension"):
        K.paged_decode_attention(torch.randn(2, 64, 4).transpose(1, 2), kv_cache, block_tables, seq_lens, 0.125)
    with pytest.raises(ValueError, match="one device"):
        K.paged_decode_attention(q, kv_cache, block_tables, seq_lens.to("meta"), 0.125)
    with pytest.raises(ValueError, match="query_start_loc must have shape"):
        K.paged_prefill_attention(
            q, kv_cache, block_tables, seq_lens, torch.tensor([0, 1], dtype=torch.int32), 0.125, max_query_len=1
        )
    with pytest.raises(ValueError, match="k must have shape"):
        K.store_kv(torch.randn(3, 2, 32), torch.randn(3, 2, 64), kv_cache, torch.tensor([0, 1, 2]))


@pytest.mark.parametrize(("dtype", "fused_residual"), grid(itertools.product(DTYPES, [False, True])), ids=_case_id)
def test_rms_norm(dtype, fused_residual):
    torch.manual_seed(3)
    x = torch.randn(7, 96).to(dtype)  # hidden not a power of two: a masked tail
    weight = (1 + 0.1 * torch.randn(96)).to(dtype)
    residual = torch.randn(7, 96).to(dtype) if fused_residual else None
    expected_residual = None if residual is None else residual.clone()
    expected = K.rms_norm_ref(x, weight, 1e-5, expected_residual)
    out = K.rms_norm(x, weight, 1e-5, residual)
    torch.testing.assert_close(out, expected, **TOL[dtype])
    if fused_residual:
        torch.testing.assert_close(residual, expected_residual, **TOL[dtype])


def _llama3_cos_sin(head_dim: int, max_positions: int):
    arch = ModelArchConfig(
        architecture="LlamaForCausalLM",
        vocab_size=8,
        hidden_size=head_dim * 2,
        intermediate_size=8,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        head_dim=head_dim,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        qkv_bias=False,
        rope_scaling=RopeScaling("llama3", factor=8.0, original_max_position_embeddings=64),
    )
    return K.rope_cos_sin(rope_inv_freq(arch), max_positions)


@pytest.mark.parametrize(
    ("dtype", "interleaved", "head_dim"), grid(itertools.product(DTYPES, [False, True], [64, 128])), ids=_case_id
)
def test_rotary_embedding(dtype, interleaved, head_dim):
    torch.manual_seed(4)
    cos, sin = _llama3_cos_sin(head_dim, 300)
    num_tokens, num_heads, num_kv_heads = 9, 6, 2
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim).to(dtype)
    q = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)  # strided, rotated in place
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim].view(num_tokens, num_kv_heads, head_dim)
    positions = torch.tensor([0, 1, 2, 7, 63, 64, 65, 200, 299])
    q_ref, k_ref = q.clone(), k.clone()
    K.rotary_embedding_ref(positions, q_ref, k_ref, cos, sin, interleaved)
    K.rotary_embedding(positions, q, k, cos, sin, interleaved)
    torch.testing.assert_close(q, q_ref, **TOL[dtype])
    torch.testing.assert_close(k, k_ref, **TOL[dtype])


def test_rotary_neox_matches_the_model_table():
    """The half table from rope_cos_sin is the model's [max_len, head_dim] table cut in half."""
    from splitserve.services.model.llama import apply_rotary

    cos, sin = _llama3_cos_sin(64, 100)
    positions = torch.tensor([3, 50, 99])
    q, k = torch.randn(3, 4, 64), torch.randn(3, 2, 64)
    full = lambda t: torch.cat((t, t), dim=-1)[positions].unsqueeze(1)  # noqa: E731
    q_model, k_model = apply_rotary(q, k, full(cos), full(sin))
    K.rotary_embedding(positions, q, k, cos, sin)
    torch.testing.assert_close(q, q_model, **TOL[torch.float32])
    torch.testing.assert_close(k, k_model, **TOL[torch.float32])


@pytest.mark.parametrize("dtype", grid(DTYPES), ids=_case_id)
def test_silu_and_mul(dtype):
    torch.manual_seed(5)
    x = (3 * torch.randn(5, 2 * 80)).to(dtype)
    torch.testing.assert_close(K.silu_and_mul(x), K.silu_and_mul_ref(x), **TOL[dtype])


def test_op_wrappers_reject_bad_inputs():
    with pytest.raises(ValueError, match="weight must have shape"):
        K.rms_norm(torch.randn(2, 8), torch.ones(4), 1e-5)
    with pytest.raises(ValueError, match="residual must have dtype"):
        K.rms_norm(torch.randn(2, 8), torch.ones(8), 1e-5, residual=torch.randn(2, 8).half())
    with pytest.raises(ValueError, match="even"):
        K.silu_and_mul(torch.randn(2, 7))
    cos, sin = _llama3_cos_sin(64, 10)
    with pytest.raises(ValueError, match="cos must have shape"):
        K.rotary_embedding(torch.tensor([0]), torch.randn(1, 2, 32), torch.randn(1, 1, 32), cos, sin)
    with pytest.raises(ValueError, match="positions must have dtype"):
        K.rotary_embedding(torch.tensor([0.0]), torch.randn(1, 2, 64), torch.randn(1, 1, 64), cos, sin)
