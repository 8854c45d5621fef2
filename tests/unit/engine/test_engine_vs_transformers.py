"""Greedy tokens must equal transformers' on the same weights, token for token."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import VOCAB_SIZE

from splitserve.common.sampling_params import SamplingParams
from splitserve.services.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from splitserve.services.engine.engine import Engine
from splitserve.services.engine.llm import LLM

MAX_NEW = 24


def _hf_greedy(folder, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                do_sample=False,
            )
            outs.append(gen[0, len(p) :].tolist())
    return outs


def _prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, VOCAB_SIZE) for _ in range(n)] for n in lengths]


def _greedy(max_new: int = MAX_NEW) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_new)


def _engine(folder, **sched) -> Engine:
    cache = sched.pop("cache", CacheConfig(block_size=8, kv_cache_bytes=4 * 1024**2))
    return Engine(EngineConfig(model=str(folder), cache=cache, scheduler=SchedulerConfig(**sched)))


def _run_all(engine: Engine) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens


@pytest.mark.parametrize("arch_dir", ["tiny_llama_dir", "tiny_qwen2_dir"])
def test_mixed_batch_matches_transformers(arch_dir, request):
    folder = request.getfixturevalue(arch_dir)
    prompts = _prompts([1, 3, 9, 17, 40, 75])
    llm = LLM(EngineConfig(model=str(folder), cache=CacheConfig(block_size=8, kv_cache_bytes=4 * 1024**2)))
    ours = [o.token_ids for o in llm.generate(prompts, _greedy())]
    assert ours == _hf_greedy(folder, prompts, MAX_NEW)
    assert llm.engine.kv.num_free_blocks == llm.engine.runner.num_blocks


def test_staggered_arrivals_match(tiny_llama_dir):
    prompts = _prompts([12, 30, 5, 50], seed=1)
    engine = _engine(tiny_llama_dir)
    tokens: dict[str, list[int]] = {}
    pending = list(enumerate(prompts))
    step = 0
    while pending or engine.has_unfinished_requests():
        if pending and step % 3 == 0:  # a new request joins while others decode
            i, p = pending.pop(0)
            engine.add_request(p, _greedy(), request_id=f"r{i}")
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        step += 1
    assert [tokens[f"r{i}"] for i in range(len(prompts))] == _hf_greedy(tiny_llama_dir, prompts, MAX_NEW)


def test_chunked_prefill_matches(tiny_llama_dir):
    prompts = _prompts([70, 45, 20], seed=2)
    engine = _engine(tiny_llama_dir, max_num_batched_tokens=16, max_num_seqs=4)
    for i, p in enumerate(prompts):
        engine.add_request(p, _greedy(), request_id=f"r{i}")
    chunks = []
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        out = engine.scheduler.schedule()
        chunks += [s.num_new_tokens for s in out.scheduled if not s.samples]
        assert out.num_batched_tokens <= 16
        batch = engine.runner.prepare(out)
        result = engine.sampler.sample(engine.runner.forward(batch), [s.request for s in batch.sampling])
        sampled = {s.request.request_id: t for s, t in zip(batch.sampling, result.token_ids)}
        for r in engine.scheduler.update_after_step(out, sampled):
            tokens.setdefault(r.request_id, []).append(r.all_token_ids[-1])
    assert chunks, "the 70-token prompt should have been split into chunks"
    assert [tokens[f"r{i}"] for i in range(3)] == _hf_greedy(tiny_llama_dir, prompts, MAX_NEW)


def test_prefix_hit_matches(tiny_llama_dir):
    shared = _prompts([40], seed=3)[0]
    prompts = [shared + [5, 6, 7], shared + [9, 10], shared]
    engine = _engine(tiny_llama_dir)
    tokens: dict[str, list[int]] = {}
    cached = {}
    for i, p in enumerate(prompts):  # one after another, so later ones hit the cache
        engine.add_request(p, _greedy(), request_id=f"r{i}")
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
                cached[out.request_id] = out.num_cached_tokens
    assert cached["r0"] == 0
    assert cached["r1"] == 40 and cached["r2"] == 32  # full blocks only, >= 1 token left to compute
    assert [tokens[f"r{i}"] for i in range(3)] == _hf_greedy(tiny_llama_dir, prompts, MAX_NEW)


def test_preemption_matches(tiny_llama_dir):
    prompts = _prompts([30, 26, 34, 22, 28], seed=4)
    # 16 blocks of 4 tokens = 64 tokens of KV for five requests that each need ~55: preemption.
    block_bytes = 2 * 2 * 4 * 2 * 16 * 4  # layers * (K,V) * block_size * kv_heads * head_dim * fp32
    engine = _engine(tiny_llama_dir, cache=CacheConfig(block_size=4, kv_cache_bytes=16 * block_bytes))
    assert engine.runner.num_blocks == 16
    for i, p in enumerate(prompts):
        engine.add_request(p, _greedy(), request_id=f"r{i}")
    preempted = 0
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        preempted += sum(r.num_preemptions for r in engine.scheduler.running)
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert preempted > 0
    assert [tokens[f"r{i}"] for i in range(5)] == _hf_greedy(tiny_llama_dir, prompts, MAX_NEW)
    assert engine.kv.num_free_blocks == 16
