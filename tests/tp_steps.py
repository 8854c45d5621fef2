"""Sharded forwards of the tiny models on real gloo groups (tests/unit/model/test_tp_model.py runs
ranks as threads, tests/integration/test_tp_model_spawned.py as spawned processes): two paged steps,
and the check that every rank got the unsharded model's logits."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from splitserve.services.engine.step_inputs import StepArrays, StepInputBuffer
from splitserve.services.model.attention.torch_backend import TorchAttention
from splitserve.services.model.loader import build_model, open_model
from splitserve.services.model.parallel import SINGLE, TensorParallel

BLOCK_SIZE = 4


NUM_BLOCKS = 8


TIMEOUT = timedelta(seconds=30)  # a rank that fails leaves the others waiting this long


# Two steps over 2 sequences (block tables [1, 2] and [3, 4, 5]; block 0 stays unused). Step 1: prompts
# of 5 and 7 tokens. Step 2: sequence 0 decodes one token, sequence 1 adds a 2-token chunk. Ids span
# every rank's part of the 320-token vocab.
STEPS = [
    ([0, 5], [5, 7], [3, 90, 170, 250, 319, 7, 80, 81, 160, 240, 241, 318]),
    ([5, 7], [1, 2], [42, 300, 123]),
]


def shard_model(folder: Path, tp: TensorParallel):
    source = open_model(folder)
    backend = TorchAttention(*tp.local_heads(source.arch), source.arch.head_dim, BLOCK_SIZE)
    return build_model(source, backend, 64, torch.float32, torch.device("cpu"), tp)


Logits = dict[tuple[str, int], list[torch.Tensor]]  # (model, group size) -> each step's [2, vocab] logits


def run_steps(folder: Path, tp: TensorParallel) -> list[torch.Tensor]:
    """The float32 logits [2, vocab] of both STEPS, on a fresh paged cache of this rank's KV heads."""
    model = shard_model(folder, tp)
    a = model.config
    kv_heads = tp.local_heads(a)[1]
    cache = torch.zeros(a.num_layers, 2, NUM_BLOCKS, BLOCK_SIZE, kv_heads, a.head_dim)
    inputs = StepInputBuffer(torch.device("cpu"), BLOCK_SIZE)
    table = np.array([[1, 2, 0], [3, 4, 5]], dtype=np.int64)
    logits = []
    with torch.inference_mode():
        for starts, query_lens, ids in STEPS:
            lens = np.array(query_lens, dtype=np.int64)
            arrays = StepArrays(np.array(ids, dtype=np.int64), np.array(starts), lens, table, lens > 0)
            batch = inputs.pack(arrays, [])
            hidden = model(batch.input_ids, batch.positions, list(cache.unbind(0)), batch.meta)
            logits.append(model.compute_logits(hidden[batch.sample_rows]))
    return logits


def run_rank(rank: int, store: dist.Store, sizes: tuple[int, ...], folders: dict[str, Path]) -> Logits:
    """This rank's logits of every model, in a group of each size in sizes that has this rank."""
    logits: Logits = {}
    for size in (s for s in sizes if rank < s):
        tp = TensorParallel(rank, size, gloo_group(store, f"tp{size}", rank, size))
        for name, folder in folders.items():
            logits[name, size] = run_steps(folder, tp)
    return logits


def gloo_group(store: dist.Store, prefix: str, rank: int, size: int) -> dist.ProcessGroupGloo:
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1", lazy_init=False)]
    options._timeout = TIMEOUT
    return dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, size, options)


def assert_logits_match(per_rank: list[Logits], folders: dict[str, Path], sizes: tuple[int, ...]) -> None:
    """Every rank got the unsharded model's logits (fp32: to ~1e-5, the same argmax)."""
    expected = {name: run_steps(folder, SINGLE) for name, folder in folders.items()}
    for rank, logits in enumerate(per_rank):
        assert set(logits) == {(name, size) for name in folders for size in sizes if rank < size}
        for (name, size), got in logits.items():
            for step, (g, e) in enumerate(zip(got, expected[name], strict=True)):
                where = f"{name}, size {size}, rank {rank}, step {step}"
                assert g.dtype == torch.float32 and g.shape == e.shape == (2, e.shape[1]), where
                torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5, msg=where)
                assert torch.equal(g.argmax(-1), e.argmax(-1)), where
