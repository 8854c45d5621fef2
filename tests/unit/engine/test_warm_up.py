"""Kernel variants and the engine warm-up (issue 20, items 7 and 8): split counts are powers of two that
the warm-up reaches one by one, the SM count is asked once per device, the warm-up leaves the engine's
output unchanged, and a worker reports SERVING only after it. On CPU the kernels run under the Triton
interpreter (tests/conftest.py); on CUDA compiled (make gpu-check runs this file there)."""

from __future__ import annotations

import itertools
import random
from types import SimpleNamespace

import pytest
import torch

from splitserve.common.sampling_params import SamplingParams
from splitserve.services.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from splitserve.services.engine.llm import LLM
from splitserve.services.engine.model_runner import StepShape, warm_up_shapes
from splitserve.services.model.attention import triton_backend

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(not triton_backend.triton_installed(), reason="triton is not installed")


@pytest.fixture
def paged_decode():
    pytest.importorskip("triton")
    from splitserve.kernels import paged_decode

    return paged_decode


# -- split counts --------------------------------------------------------------------------------------
@needs_triton
def test_split_counts_are_powers_of_two(paged_decode):
    choose = paged_decode.choose_num_splits
    for num_seqs, kv_heads, max_len, sms in itertools.product(
        [1, 2, 3, 7, 64, 300], [1, 2, 8], [1, 255, 256, 700, 4096, 40000], [0, 1, 108, 132]
    ):
        n = choose(num_seqs, kv_heads, max_len, sms)
        assert n & (n - 1) == 0 and 1 <= n <= 32, (num_seqs, kv_heads, max_len, sms, n)
    assert choose(1, 8, 40000, 0) == 1  # no GPU: one split
    assert choose(1, 8, 3 * 256, 132) == 2  # 3 by length, rounded down: >= 256 tokens per split stays true
    assert choose(1, 1, 40000, 132) == 32


@needs_triton
@pytest.mark.parametrize(("kv_heads", "max_len", "sms"), [(8, 32768, 132), (2, 2048, 132), (8, 512, 16), (1, 100, 132)])
def test_warm_up_lens_reach_every_split_count(paged_decode, kv_heads, max_len, sms):
    lens = paged_decode.decode_warm_up_lens(kv_heads, max_len, sms)
    for splits, seq_len in lens.items():
        assert 1 <= seq_len <= max_len
        assert paged_decode.choose_num_splits(1, kv_heads, seq_len, sms) == splits
    reachable = {
        paged_decode.choose_num_splits(n, kv_heads, length, sms)
        for n in (1, 2, 3, 5, 16, 64, 256)
        for length in range(1, max_len + 1, 37)
    }
    assert reachable <= set(lens)


@needs_triton
def test_sm_count_is_asked_once_per_device(paged_decode, monkeypatch):
    calls = []

    def properties(index):
        calls.append(index)
        return SimpleNamespace(multi_processor_count=132)

    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    paged_decode._cuda_sm_count.cache_clear()
    try:
        for _ in range(3):
            assert paged_decode.sm_count(torch.device("cuda", 0)) == 132
            assert paged_decode.sm_count(torch.device("cuda")) == 132
        assert calls == [0]
        assert paged_decode.sm_count(torch.device("cpu")) == 0
    finally:
        paged_decode._cuda_sm_count.cache_clear()  # no mocked count left for later tests


@needs_triton
# bf16 under the interpreter only on CUDA: test_kernels.py already covers the bf16 decode path on CPU.
@pytest.mark.kernels  # the engine on the interpreted kernels: `make test`, not the unit run
@pytest.mark.parametrize("dtype", [torch.float32] + ([torch.bfloat16] if torch.cuda.is_available() else []))
def test_power_of_two_split_counts_match_the_reference(paged_decode, dtype, monkeypatch):
    from splitserve import kernels as K

    if DEVICE == "cpu":  # an SM count as on a GPU, so the wrapper's own choice below splits
        monkeypatch.setattr(paged_decode, "sm_count", lambda device: 132)

    torch.manual_seed(3)
    lens, block_size, kv_heads, group, head_dim = [1, 16, 130, 600], 16, 2, 2, 64
    blocks = [-(-n // block_size) for n in lens]
    order = torch.randperm(sum(blocks) + 2).tolist()
    tables = [order[sum(blocks[:i]) : sum(blocks[: i + 1])] for i in range(len(lens))]
    with torch.device(DEVICE):
        kv_cache = torch.randn(2, sum(blocks) + 2, block_size, kv_heads, head_dim).to(dtype)
        block_tables = torch.tensor([t + [0] * (max(blocks) - len(t)) for t in tables])
        seq_lens = torch.tensor(lens, dtype=torch.int32)
        q = torch.randn(len(lens), kv_heads * group, head_dim).to(dtype)
    scale = head_dim**-0.5
    expected = K.paged_decode_attention_ref(q, kv_cache, block_tables, seq_lens, scale)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=1.6e-2)
    for splits in (2, 8, 32):  # 32: most splits are empty for every sequence here
        out = K.paged_decode_attention(q, kv_cache, block_tables, seq_lens, scale, num_splits=splits)
        torch.testing.assert_close(out, expected, **tol)
    # The wrapper's own choice (600 tokens: 2 splits), on views that start at row 1, as the backend
    # passes after a step's first sequences (index arrays at any alignment).
    assert paged_decode.choose_num_splits(3, kv_heads, 600, paged_decode.sm_count(q.device)) == 2
    out = K.paged_decode_attention(q[1:], kv_cache, block_tables[1:], seq_lens[1:], scale, max_seq_len=600)
    torch.testing.assert_close(out, expected[1:], **tol)


@needs_triton
def test_triton_backend_names_a_decode_per_split_count(paged_decode, monkeypatch):
    monkeypatch.setattr(paged_decode, "_cuda_sm_count", lambda index: 132)
    backend = triton_backend.TritonAttention(num_heads=4, num_kv_heads=2, head_dim=16, block_size=8)
    assert backend.warm_up_decode_lens(4096, torch.device("cuda", 0)) == [1, 512, 1024, 2048, 4096]
    assert backend.warm_up_decode_lens(4096, torch.device("cpu")) == [1]


# -- the warm-up steps ---------------------------------------------------------------------------------
def test_warm_up_shapes():
    big, *decodes = warm_up_shapes(2048, 64, 4096, [1, 512, 1024], on_gpu=True)
    assert sum(big.query_lens) == 2048 and big.seq_lens == big.query_lens  # the token budget, whole prompts
    assert len(big.seq_lens) <= 64 and max(big.seq_lens) <= 4096
    assert decodes == [StepShape((1,), (1,)), StepShape((512,), (1,)), StepShape((1024,), (1,))]
    assert warm_up_shapes(2048, 64, 4096, [], on_gpu=False) == [StepShape((2, 8), (1, 8))]
    assert warm_up_shapes(2048, 1, 4096, [], on_gpu=False) == [StepShape((8,), (8,))]
    assert warm_up_shapes(4, 4, 4096, [], on_gpu=False) == [StepShape((2, 3), (1, 3))]
    assert warm_up_shapes(2, 2, 2, [], on_gpu=False) == [StepShape((2, 1), (1, 1))]


def _llm(folder, backend: str) -> LLM:
    return LLM(
        EngineConfig(
            model=str(folder),
            dtype="float32",
            attention_backend=backend,
            cache=CacheConfig(block_size=8, kv_cache_bytes=2 * 1024**2),
            scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64),
        )
    )


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6))]


PROMPTS = [[random.Random(i).randrange(1, 300) for _ in range(n)] for i, n in enumerate([3, 17, 30])]


def test_warm_up_runs_one_small_step_and_changes_no_output(tiny_llama_dir):
    expected = _greedy(_llm(tiny_llama_dir, "torch"), PROMPTS)
    llm = _llm(tiny_llama_dir, "torch")
    report = llm.engine.warm_up()
    assert report.num_steps == 1 and report.seconds >= 0  # the torch backend has no decode variants
    assert _greedy(llm, PROMPTS) == expected  # the scratch values it left in block 0 are never read
    assert llm.engine.kv.num_free_blocks == llm.engine.runner.num_blocks
    with pytest.raises(RuntimeError, match="before the first step"):
        llm.engine.warm_up()


@pytest.mark.kernels  # the engine on the interpreted kernels: `make test`, not the unit run
@needs_triton
def test_full_warm_up_on_the_triton_backend(tiny_llama_dir, monkeypatch):
    """The GPU plan (token budget + a decode per split count) on the Triton backend, then the same tokens
    as the torch backend. On CPU with an SM count as on a GPU, so the 512-token decode takes 2 splits."""
    from splitserve.kernels import paged_decode

    if DEVICE == "cpu":
        monkeypatch.setattr(paged_decode, "sm_count", lambda device: 132)
    expected = _greedy(_llm(tiny_llama_dir, "torch"), PROMPTS)
    llm = _llm(tiny_llama_dir, "triton")
    runner = llm.engine.runner
    assert runner.backend.warm_up_decode_lens(runner.max_model_len, torch.device("cuda")) == [1, 512]
    report = runner.warm_up(full=True)
    assert report.num_steps == 3
    assert _greedy(llm, PROMPTS) == expected
