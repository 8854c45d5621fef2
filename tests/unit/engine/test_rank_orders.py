"""Tensor parallelism inside a worker (services/engine/ranks.py): follower rank processes over gloo, the KV cache
sharded by KV head, KV handed off rank to rank between tiers of different sizes, and a lost rank
ending its worker. The model's sharding itself is tests/unit/model/test_tp_model.py; the handoff's plan for every
pair of sizes, tests/unit/disagg/test_handoff_plan.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from splitserve.services.engine.config import CacheConfig, EngineConfig
from splitserve.services.engine.llm import LLM
from splitserve.services.engine.ranks import Op, decode, encode, step_arrays_from_wire, step_arrays_to_wire
from splitserve.services.engine.step_inputs import StepArrays


def _llm(folder, tp: int, **overrides) -> LLM:
    cache = CacheConfig(block_size=8, kv_cache_bytes=4 * 1024**2)
    return LLM(EngineConfig(model=str(folder), max_model_len=256, cache=cache, tensor_parallel_size=tp, **overrides))


def test_orders_round_trip_the_pipe_encoding():
    arrays = StepArrays(
        np.array([5, 6, 7], dtype=np.int64),
        np.array([4, 0], dtype=np.int64),
        np.array([1, 2], dtype=np.int64),
        np.array([[3, 0], [1, 2]], dtype=np.int64),
        np.array([True, False]),
        np.array([9], dtype=np.int64),
    )
    order = decode(encode(Op.STEP, *step_arrays_to_wire(arrays)))
    back = step_arrays_from_wire(order.arrays)
    assert order.kind == Op.STEP and order.number == 0 and back.samples.dtype == bool
    for name in ("input_ids", "starts", "query_lens", "block_table", "samples", "decode_seq_ids"):
        assert np.array_equal(getattr(back, name), getattr(arrays, name)), name
    assert decode(encode(Op.STOP)) == (Op.STOP, 0, [])
    empty = decode(encode(Op.DISCARD_KV, np.zeros(0, dtype=np.int64), number=7))
    assert (empty.kind, empty.number, empty.arrays[0].shape) == (Op.DISCARD_KV, 7, (0,))


def test_a_rank_reads_and_writes_slices_of_its_kv_heads(tiny_llama_dir):
    """What each rank of a handoff does with its piece (global heads, here rank 0 of 1 holding both)."""
    llm = _llm(tiny_llama_dir, 1)
    runner = llm.engine.runner
    piece = torch.randn(2, 2, 3, 8, 1, 16)  # [layers, K/V, blocks, block_size, heads of the piece, head_dim]
    runner.write_heads([5, 9, 2], range(1, 2), piece)
    assert torch.equal(runner.read_heads([5, 9, 2], range(1, 2)), piece)
    assert not runner.read_heads([5, 9, 2], range(0, 1)).any()  # head 0 untouched
    staging = runner.acquire_piece(3, 1)
    assert torch.equal(runner.read_heads([2], range(1, 2), staging.tensor[:, :, :1]), piece[:, :, 2:3])
    assert runner.read_heads([9], range(0, 2)).shape == (2, 2, 1, 8, 2, 16)  # every head: whole blocks
    with pytest.raises(ValueError, match="holds KV heads"):
        runner.read_heads([5], range(1, 3))
    # As a receive writes it, a range of rows (layer and K/V) at a time: head 0 of other blocks.
    write = runner.row_writer([1, 4, 7], range(0, 1), piece)
    for rows in (slice(0, 1), slice(1, 3), slice(3, 4)):
        write(rows)
    assert torch.equal(runner.read_heads([1, 4, 7], range(0, 1)), piece)
    assert not runner.read_heads([1, 4, 7], range(1, 2)).any()  # head 1 untouched
