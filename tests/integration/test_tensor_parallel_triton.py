"""The triton attention backend under tensor parallelism (tests/unit/model/test_kernels_engine.py has it alone)."""

from __future__ import annotations

import pytest

from splitserve.common.sampling_params import SamplingParams
from splitserve.services.engine.config import CacheConfig, EngineConfig
from splitserve.services.engine.llm import LLM
from splitserve.services.model.attention import triton_backend

pytestmark = [
    pytest.mark.skipif(not triton_backend.triton_installed(), reason="triton is not installed"),
]


def test_triton_backend_under_tensor_parallelism(tiny_llama_dir):
    """2 ranks on the triton backend (each attending over its 2 query heads and 1 KV head, the
    follower rank under the interpreter too: it inherits TRITON_INTERPRET) = 1 rank on torch."""
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9], list(range(10, 30))]
    params = SamplingParams(temperature=0.0, max_tokens=6)
    cache = CacheConfig(block_size=8, kv_cache_bytes=1024**2)
    expected = [
        o.token_ids for o in LLM(EngineConfig(model=str(tiny_llama_dir), cache=cache)).generate(prompts, params)
    ]
    config = EngineConfig(model=str(tiny_llama_dir), attention_backend="triton", tensor_parallel_size=2, cache=cache)
    llm = LLM(config)
    try:
        assert isinstance(llm.engine.runner.backend.ops, triton_backend.TritonOps)
        assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    finally:
        llm.engine.close()
