"""Decode steps replayed from CUDA graphs: at small batch a decode step is bound by kernel launches (tens
per layer), and a graph launches them all at once.

Lifecycle:  captured (ModelRunner.warm_up, before health is SERVING) -> replayed (every step whose
sequences all decode, n of them, n <= the largest captured size) -> gone with the runner.

One recording per batch size in capture_sizes (1, 2, 4, ... up to min(max_num_seqs, max_batch_size)),
the largest first, all sharing one memory pool and one set of static input buffers (StaticInputs: a
graph of size s reads their first s rows). A step of n decodes copies its inputs into the first n rows,
pads rows n..s-1 of the smallest size s >= n, replays, and reads the first n rows of the output
(hidden states before the final norm; the logits and the sampling run eagerly, on the sampled rows).

What a replay cannot change, the recording fixes (the host side of the step is not run again):
- the number of sequences (s) and that all of them decode: the attention metadata is built once per
  size, with num_decodes = s and host lengths of max_model_len;
- the decode kernel's split count (the Triton backend would choose it from max(seq_lens_cpu) each
  step): AttentionMetadata.decode_num_splits, what the backend chooses for s sequences of
  max_model_len tokens (AttentionBackend.graph_decode_splits); a shorter context leaves trailing
  splits empty, which the kernel allows. A backend that reads per-step values on the host (the torch
  backend sizes its gathers and masks from them) returns None there: no graphs on it;
- every tensor's address: inputs are copied into the static buffers, never rebound.
Padding rows store nothing (slot PAD_SLOT_ID, skipped by store_kv) and attend to one token (seq_len 1)
of the block their table row names (block 0, or a block id an earlier step left: a valid one).

On CUDA the recording is a torch.cuda.CUDAGraph (CudaGraphCapture); elsewhere nothing is captured
unless a Capture is given: EagerCapture runs the recorded forward again on each replay, with the same
static buffers, padding, size choice and frozen metadata (what the CPU tests check).
"""

from __future__ import annotations

import bisect
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from splitserve.services.engine.step_inputs import ForwardBatch
from splitserve.services.model.attention import AttentionBackend, AttentionMetadata
from splitserve.services.model.attention.backend import PAD_SLOT_ID

Forward = Callable[[], torch.Tensor]  # one forward over the static buffers: [size, hidden]


def capture_sizes(max_num_seqs: int, max_batch_size: int) -> list[int]:
    """Batch sizes to capture, ascending: the powers of two below min(max_num_seqs, max_batch_size),
    then that limit itself (so every decode batch up to it has a graph)."""
    limit = min(max_num_seqs, max_batch_size)
    return [1 << i for i in range(limit.bit_length()) if 1 << i < limit] + [limit]


def graph_size(sizes: Sequence[int], num_seqs: int) -> int | None:
    """The smallest size in sizes (ascending) holding num_seqs sequences; None: more than the largest."""
    i = bisect.bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) else None


class Capture(ABC):
    """Records a forward over static buffers so that it can be replayed."""

    @abstractmethod
    def capture(self, forward: Forward) -> Forward:
        """forward reads only static tensors; the result runs it again (a replay) and returns its output,
        [size, hidden], valid until the next replay of any size (they may share memory)."""


class CudaGraphCapture(Capture):
    """torch.cuda.CUDAGraph recordings sharing one memory pool (capture the largest first: the smaller
    ones then fit in what it freed). Call under torch.inference_mode, on the device's thread."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()

    def capture(self, forward: Forward) -> Forward:
        # A run outside the capture first, on a side stream (as torch's docs do): Triton compiles and
        # loads its kernels and cuBLAS makes its workspaces there, never inside the recording.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            forward()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = forward()

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay


class EagerCapture(Capture):
    """No recording: each replay runs forward again (same buffers and metadata as a graph would)."""

    def capture(self, forward: Forward) -> Forward:
        return forward


def default_capture(device: torch.device) -> Capture | None:
    """CUDA graphs on a CUDA device; None elsewhere (nothing to gain)."""
    return CudaGraphCapture(device) if device.type == "cuda" else None


@dataclass(frozen=True, slots=True)
class StaticInputs:
    """The inputs every graph reads, sized for the largest one (a graph of size s reads the first s rows)."""

    input_ids: torch.Tensor  # [max_size] int64
    positions: torch.Tensor  # [max_size] int64
    slot_mapping: torch.Tensor  # [max_size] int64; PAD_SLOT_ID in padding rows
    seq_lens: torch.Tensor  # [max_size] int32; 1 in padding rows
    block_tables: torch.Tensor  # [max_size, max_blocks_per_seq] int64
    query_start_loc: torch.Tensor  # [max_size + 1] int32: 0, 1, 2, ... (one token per sequence)

    @classmethod
    def new(cls, max_size: int, max_blocks_per_seq: int, device: torch.device) -> StaticInputs:
        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.int64, device=device)

        return cls(
            input_ids=zeros(max_size),
            positions=zeros(max_size),
            slot_mapping=torch.full((max_size,), PAD_SLOT_ID, dtype=torch.int64, device=device),
            seq_lens=torch.ones(max_size, dtype=torch.int32, device=device),
            block_tables=zeros(max_size, max_blocks_per_seq),
            query_start_loc=torch.arange(max_size + 1, dtype=torch.int32, device=device),
        )

    def load(self, batch: ForwardBatch, size: int) -> None:
        """A decode step's n inputs into rows 0..n-1; rows n..size-1 pad. Only the step's block-table
        columns are copied: a kernel reads no column past its sequence's length."""
        n, width = batch.meta.block_tables.shape
        self.input_ids[:n].copy_(batch.input_ids, non_blocking=True)
        self.positions[:n].copy_(batch.positions, non_blocking=True)
        self.slot_mapping[:n].copy_(batch.meta.slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(batch.meta.seq_lens, non_blocking=True)
        self.block_tables[:n, :width].copy_(batch.meta.block_tables, non_blocking=True)
        if n < size:  # a padding row's other inputs may be an earlier step's: valid ids, positions and blocks
            self.slot_mapping[n:size].fill_(PAD_SLOT_ID)
            self.seq_lens[n:size].fill_(1)

    def meta(self, size: int, max_seq_len: int, num_splits: int) -> AttentionMetadata:
        """Metadata of a graph of size decodes: views of the buffers; host values for any context up to
        max_seq_len (what a replay cannot recompute)."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            block_tables=self.block_tables[:size],
            seq_lens=self.seq_lens[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            num_decodes=size,
            max_seq_len=max_seq_len,
            seq_lens_cpu=[max_seq_len] * size,
            query_lens_cpu=[1] * size,
            decode_num_splits=num_splits,
        )


@dataclass(frozen=True, slots=True)
class GraphTarget:
    """What the graphs run: the model over its KV cache, for contexts up to max_model_len."""

    model: torch.nn.Module  # LlamaForCausalLM: (input_ids, positions, kv_caches, meta) -> [tokens, hidden]
    backend: AttentionBackend
    kv_caches: list[torch.Tensor]  # per layer [2, num_blocks, block_size, kv_heads, head_dim]
    max_model_len: int
    block_size: int
    device: torch.device


class DecodeGraphs:
    """Decode steps of up to max(sizes) sequences, each replayed from the recording of its padded size."""

    def __init__(self, sizes: list[int], inputs: StaticInputs, replays: dict[int, Forward]) -> None:
        self.sizes = sizes  # ascending
        self.inputs = inputs
        self._replays = replays

    @classmethod
    def capture(cls, target: GraphTarget, sizes: list[int], capture: Capture) -> DecodeGraphs:
        """Record one forward per size, the largest first. ValueError if the backend cannot replay decodes
        (graph_decode_splits is None). The recordings store nothing in the KV cache (every row pads)."""
        max_blocks = -(-target.max_model_len // target.block_size)
        inputs = StaticInputs.new(max(sizes), max_blocks, target.device)
        replays = {}
        for size in sorted(sizes, reverse=True):
            splits = target.backend.graph_decode_splits(size, target.max_model_len, target.device)
            if splits is None:
                raise ValueError(f"the {target.backend.name} attention backend cannot replay decodes from a graph")
            replays[size] = capture.capture(_forward(target, inputs, inputs.meta(size, target.max_model_len, splits)))
        return cls(sorted(sizes), inputs, replays)

    def try_forward(self, batch: ForwardBatch) -> torch.Tensor | None:
        """Hidden states [n, hidden] of a step of n decodes (n <= the largest size) from its graph, valid
        until the next replay; None for any other step (run it eagerly)."""
        meta = batch.meta
        n = meta.num_seqs
        if meta.num_decodes != n:
            return None
        size = graph_size(self.sizes, n)
        if size is None or meta.block_tables.shape[1] > self.inputs.block_tables.shape[1]:
            return None
        self.inputs.load(batch, size)
        return self._replays[size]()[:n]


def _forward(target: GraphTarget, inputs: StaticInputs, meta: AttentionMetadata) -> Forward:
    size = meta.num_seqs
    ids, positions = inputs.input_ids[:size], inputs.positions[:size]
    return lambda: target.model(ids, positions, target.kv_caches, meta)
