"""Tensor-parallel model layers (services/model/parallel.py): the sharding arithmetic, each rank's loaded shard,
and sharded models on real gloo groups giving the logits of the unsharded model.

The unit forward test runs 4 ranks as threads of this process (gloo over loopback, no process start-up):
all 4 form a size-4 group (more ranks than the fixtures' 2 KV heads: each KV head replicated on 2 ranks)
and ranks 0 and 1 also a size-2 group; each group runs the tiny Llama, the tied, biased Qwen2 and a
Llama with a vocab no size divides (padded shards) over a prefill step, then a step that reads the
cache back (a decode and a chunk after a cached prefix). The integration test runs size 2 as two
spawned processes meeting at a TCPStore, as the executor does.
"""

from __future__ import annotations

import json
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from tp_steps import (
    BLOCK_SIZE,
    assert_logits_match,
    run_rank,
    shard_model,
)

from splitserve.common.model_files import ModelLoadError
from splitserve.services.model.arch import ModelArchConfig
from splitserve.services.model.attention.torch_backend import TorchAttention
from splitserve.services.model.loader import build_model, open_model
from splitserve.services.model.parallel import SINGLE, TensorParallel, possible_sizes


def arch(num_heads: int = 4, num_kv_heads: int = 2, intermediate_size: int = 192) -> ModelArchConfig:
    return ModelArchConfig.from_hf_config(
        dict(
            architectures=["LlamaForCausalLM"],
            vocab_size=320,
            hidden_size=64,
            intermediate_size=intermediate_size,
            num_hidden_layers=1,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=16,
        )
    )


# --- sharding arithmetic ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("size", "ranges"),
    [
        (1, [range(0, 2)]),
        (2, [range(0, 1), range(1, 2)]),
        (4, [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]),  # replicated: its query heads' group
        (8, [range(h, h + 1) for h in (0, 0, 0, 0, 1, 1, 1, 1)]),
    ],
)
def test_kv_head_range(size, ranges):
    assert [TensorParallel(rank, size).kv_head_range(2) for rank in range(size)] == ranges


def test_replicated_kv_head_is_the_one_its_query_heads_read():
    a = arch(num_heads=8, num_kv_heads=2)  # query heads 0-3 read KV head 0, 4-7 read KV head 1
    for rank in range(4):
        tp = TensorParallel(rank, 4)
        assert tp.local_heads(a) == (2, 1)
        query_heads = range(rank * 2, rank * 2 + 2)
        assert {q // 4 for q in query_heads} == set(tp.kv_head_range(2))


def test_local_heads_and_vocab_shards():
    a = arch(num_heads=4, num_kv_heads=2)
    assert TensorParallel(0, 1).local_heads(a) == (4, 2)
    assert TensorParallel(1, 2).local_heads(a) == (2, 1)
    assert TensorParallel(3, 4).local_heads(a) == (1, 1)
    assert TensorParallel(0, 3).vocab_per_rank(320) == 107  # 321 padded rows
    assert [TensorParallel(r, 3).vocab_range(320) for r in range(3)] == [
        range(0, 107),
        range(107, 214),
        range(214, 320),
    ]
    assert TensorParallel(3, 4).vocab_range(2) == range(2, 2)  # nothing real left for the last rank


@pytest.mark.parametrize(
    ("a", "size", "message"),
    [
        (arch(), 3, "tensor-parallel size 3 cannot shard .*4 query heads .* Sizes that can: 1, 2, 4"),
        (arch(num_heads=6, num_kv_heads=3), 2, "3 KV heads do not split evenly over 2 ranks.* 1, 3, 6"),
        (arch(num_heads=12, num_kv_heads=3), 4, "4 ranks are not a multiple of its 3 KV heads.* 1, 3, 6, 12"),
        (arch(intermediate_size=130), 4, "intermediate size 130 .* Sizes that can: 1, 2$"),
    ],
)
def test_check_refuses_sizes_that_do_not_divide(a, size, message):
    with pytest.raises(ValueError, match=message):
        TensorParallel(0, size).check(a)


def test_possible_sizes_and_bad_ranks():
    assert possible_sizes(arch(num_heads=8, num_kv_heads=2)) == [1, 2, 4, 8]
    with pytest.raises(ValueError, match="rank 2 of size 2"):
        TensorParallel(2, 2)
    with pytest.raises(RuntimeError, match="needs a process group"):
        TensorParallel(0, 2).all_reduce(torch.ones(2))


def test_build_model_refuses_a_size_that_does_not_divide(tiny_llama_dir):
    source = open_model(tiny_llama_dir)
    backend = TorchAttention(4, 2, 16, BLOCK_SIZE)
    with pytest.raises(ValueError, match="size 3 cannot shard .* Sizes that can: 1, 2, 4"):
        build_model(source, backend, 64, torch.float32, torch.device("cpu"), TensorParallel(0, 3))


def test_backend_must_be_built_for_the_local_heads(tiny_llama_dir):
    source = open_model(tiny_llama_dir)
    with pytest.raises(ValueError, match="built for 4 query / 2 KV heads, this rank holds 2 / 1"):
        build_model(source, TorchAttention(4, 2, 16, BLOCK_SIZE), 64, torch.float32, "cpu", TensorParallel(0, 2))


# --- each rank's shard, loaded in this process (no group: nothing runs) -------------------------------


@pytest.mark.parametrize("size", [2, 4])
def test_each_rank_loads_its_shard(tiny_qwen2_dir, size):
    full = dict(shard_model(tiny_qwen2_dir, SINGLE).named_parameters(remove_duplicate=False))
    d, kv_heads = 16, 2
    q_all, k_all, v_all = full["layers.0.self_attn.qkv_proj.weight"].split([4 * d, kv_heads * d, kv_heads * d])
    bias_q = full["layers.0.self_attn.qkv_proj.bias"][: 4 * d]
    gate_all, up_all = full["layers.1.mlp.gate_up_proj.weight"].chunk(2)
    shards = []
    for rank in range(size):
        tp = TensorParallel(rank, size)
        p = dict(shard_model(tiny_qwen2_dir, tp).named_parameters(remove_duplicate=False))
        shards.append(p)
        q_rows = (4 // size) * d  # this rank's query heads' rows
        heads, kv = range(rank * q_rows, (rank + 1) * q_rows), tp.kv_head_range(kv_heads)
        kv_rows = slice(kv.start * d, kv.stop * d)
        q, k, v = p["layers.0.self_attn.qkv_proj.weight"].split([len(heads), len(kv) * d, len(kv) * d])
        assert torch.equal(q, q_all[heads.start : heads.stop])
        assert torch.equal(k, k_all[kv_rows]) and torch.equal(v, v_all[kv_rows])
        assert torch.equal(p["layers.0.self_attn.qkv_proj.bias"][: len(heads)], bias_q[heads.start : heads.stop])
        inter = slice(rank * 128 // size, (rank + 1) * 128 // size)
        gate, up = p["layers.1.mlp.gate_up_proj.weight"].chunk(2)
        assert torch.equal(gate, gate_all[inter]) and torch.equal(up, up_all[inter])
        assert p["lm_head.weight"] is p["embed_tokens.weight"]  # tied: one shard
    for name in ("layers.0.self_attn.o_proj.weight", "layers.1.mlp.down_proj.weight"):
        assert torch.equal(torch.cat([s[name] for s in shards], dim=1), full[name])
    assert torch.equal(torch.cat([s["embed_tokens.weight"] for s in shards]), full["embed_tokens.weight"])
    assert torch.equal(shards[-1]["norm.weight"], full["norm.weight"])  # replicated


def test_a_shard_of_a_wrong_sized_tensor_is_refused(tiny_llama_dir, tmp_path):
    """The whole checkpoint tensor is checked, not just the part this rank takes (which would fit)."""
    shutil.copytree(tiny_llama_dir, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    message = "shape mismatch for 'model.layers.0.mlp.down_proj.weight': checkpoint (64, 128), config expects (64, 96)"
    with pytest.raises(ModelLoadError, match=re.escape(message)):  # its columns 0-47 alone would fit
        shard_model(tmp_path / "m", TensorParallel(0, 2))


@pytest.fixture(scope="module")
def odd_vocab_dir(tiny_llama_dir, tmp_path_factory) -> Path:
    """The tiny Llama with one more (random) token: 321 rows, which no size > 1 divides."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path_factory.mktemp("tiny-llama-321")
    config = json.loads((tiny_llama_dir / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "vocab_size": 321}))
    shutil.copy(tiny_llama_dir / "tokenizer.json", folder)
    tensors = load_file(tiny_llama_dir / "model.safetensors")
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        tensors[name] = torch.cat([tensors[name], torch.randn(1, 64, generator=torch.Generator().manual_seed(1))])
    save_file(tensors, folder / "model.safetensors")
    return folder


def test_vocab_padding_rows_are_zero(odd_vocab_dir):
    last = dict(shard_model(odd_vocab_dir, TensorParallel(1, 2)).named_parameters())  # ids 161-320, 1 pad row
    assert last["embed_tokens.weight"].shape == last["lm_head.weight"].shape == (161, 64)
    assert not last["embed_tokens.weight"][160].any() and not last["lm_head.weight"][160].any()


# --- sharded forwards: ranks on real gloo groups, as threads of this process or as processes --------


def test_sharded_logits_match_the_whole_model(tiny_llama_dir, tiny_qwen2_dir, odd_vocab_dir):
    """4 ranks as threads (gloo over loopback, a HashStore): sizes 4 (KV heads replicated) and 2."""
    folders = {"llama": tiny_llama_dir, "qwen2": tiny_qwen2_dir, "llama-321": odd_vocab_dir}
    store, sizes = dist.HashStore(), (4, 2)
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(run_rank, rank, store, sizes, folders) for rank in range(4)]
        per_rank = [f.result() for f in futures]
    assert_logits_match(per_rank, folders, sizes)
