"""The engine on the `triton` attention backend (under the Triton interpreter on CPU: TRITON_INTERPRET=1
from tests/conftest.py) against the `torch` one:
same greedy tokens on the tiny test models (Llama, Qwen2), across mixed batches, chunked prefill and prefix
hits, with attention, RMSNorm (residual add fused), RoPE and SiLU-and-mul all on the kernels."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import VOCAB_SIZE

from splitserve.common.sampling_params import SamplingParams
from splitserve.services.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from splitserve.services.engine.llm import LLM
from splitserve.services.model.attention import default_backend_name, get_backend, triton_backend

pytestmark = [
    pytest.mark.kernels,  # whole engines on the interpreted kernels: `make test`, not the unit run
    pytest.mark.skipif(not triton_backend.triton_installed(), reason="triton is not installed"),
]


def _generate(folder, backend: str, prompts: list[list[list[int]]], max_tokens: int, **sched):
    """Greedy tokens of each prompt, groups one after another (later groups can hit the prefix
    cache), and how many prompt tokens each found cached."""
    config = EngineConfig(
        model=str(folder),
        attention_backend=backend,
        dtype="float32",
        scheduler=SchedulerConfig(**sched),
        cache=CacheConfig(block_size=8, kv_cache_bytes=1024**2),
    )
    llm = LLM(config)
    runner = llm.engine.runner
    assert runner.backend.name == backend
    assert runner.model.layers[0].mlp.ops is runner.backend.ops  # the model's other ops come from the backend
    assert isinstance(runner.backend.ops, triton_backend.TritonOps) == (backend == "triton")
    outs = []
    for group in prompts:
        outs += llm.generate(group, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    return [o.token_ids for o in outs], [o.num_cached_tokens for o in outs]


@pytest.mark.parametrize("model_dir", ["tiny_llama_dir", "tiny_qwen2_dir"])
def test_triton_backend_matches_torch_backend(model_dir, request):
    folder = request.getfixturevalue(model_dir)
    rng = random.Random(7)
    shared = [rng.randrange(1, VOCAB_SIZE) for _ in range(20)]
    prompts = [
        [[rng.randrange(1, VOCAB_SIZE) for _ in range(n)] for n in (1, 9, 30)] + [shared],
        [shared + [5, 6], shared + [7]],
    ]  # the second group hits the first's cached blocks
    # 16 tokens a step: the 30- and 20-token prompts are prefilled in chunks next to running decodes.
    sched = dict(max_num_batched_tokens=16, max_num_seqs=8)
    expected, _ = _generate(folder, "torch", prompts, 6, **sched)
    tokens, cached = _generate(folder, "triton", prompts, 6, **sched)
    assert tokens == expected
    assert cached[-2:] == [16, 16]


def test_backend_selection(monkeypatch):
    cpu = torch.device("cpu")
    assert default_backend_name(cpu) == "torch"
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        get_backend("triton", cpu)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert get_backend("triton", cpu) is triton_backend.TritonAttention
    monkeypatch.setattr(triton_backend, "triton_installed", lambda: False)
    with pytest.raises(RuntimeError, match="needs the triton package"):
        get_backend("triton", cpu)
