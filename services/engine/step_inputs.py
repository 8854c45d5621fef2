"""A step's integer inputs, computed over whole arrays with numpy and moved to the device at once.

Per step the host does two list comprehensions over the decodes (their computed tokens and last
token) and a fixed number of numpy ops: positions, slots, sequence lengths and sampled rows are
computed over whole arrays, and the block table comes gathered from the KV cache manager's
persistent rows. On CPU the tensors wrap the arrays; on CUDA the arrays are packed into one
persistent pinned buffer and copied with one non-blocking copy (the buffer is reused: the next step
waits for the previous copy before rewriting it).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from splitserve.services.engine.request import Request
from splitserve.services.engine.scheduler_output import ScheduledRequest, SchedulerOutput
from splitserve.services.model.attention import AttentionMetadata


@dataclass(slots=True)
class ForwardBatch:
    """Host-built inputs of one step."""

    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # [num_sampling_seqs]: index of each sampling sequence's last token
    sampling_requests: list[Request]  # the requests that sample, in sample_rows order
    out: SchedulerOutput | None = None  # the schedule it was built from (None: a warm-up shape)
    arrays: StepArrays | None = None  # the host arrays it was packed from (what follower ranks get)

    @property
    def sampling(self) -> list[ScheduledRequest]:
        """The scheduled requests that sample, in sample_rows order."""
        return [s for s in self.out.scheduled if s.samples] if self.out is not None else []


@dataclass(slots=True)
class StepArrays:
    """One step's inputs as host arrays (int64), before packing."""

    input_ids: np.ndarray  # [num_tokens]
    starts: np.ndarray  # [num_seqs]: tokens already computed (the first position of this step's tokens)
    query_lens: np.ndarray  # [num_seqs]: this step's tokens of each sequence, decodes (1) first
    block_table: np.ndarray  # [num_seqs, max_blocks]: block ids, rows padded with 0
    samples: np.ndarray  # [num_seqs] bool: the sequence samples a token (from its last one)
    decode_seq_ids: np.ndarray | None = None  # [num_decodes]: Request.arrival_seq; None: a warm-up shape


def scheduled_arrays(out: SchedulerOutput) -> StepArrays:
    """The step's arrays, in batch order (decodes, then chunks)."""
    decodes, chunks = out.decodes, out.chunks
    starts = [r.num_computed_tokens for r in decodes]
    input_ids = [r.all_token_ids[-1] for r in decodes]  # a decode's one new token is its last
    for s in chunks:
        start = s.request.num_computed_tokens
        starts.append(start)
        input_ids.extend(s.request.all_token_ids[start : start + s.num_new_tokens])
    query_lens = np.ones(len(decodes) + len(chunks), dtype=np.int64)
    samples = np.ones(len(query_lens), dtype=bool)
    if chunks:
        query_lens[len(decodes) :] = [s.num_new_tokens for s in chunks]
        samples[len(decodes) :] = [s.samples for s in chunks]
    return StepArrays(
        np.array(input_ids, dtype=np.int64),
        np.array(starts, dtype=np.int64),
        query_lens,
        out.block_table,
        samples,
        np.array([r.arrival_seq for r in decodes], dtype=np.int64),
    )


def num_leading_ones(query_lens: np.ndarray) -> int:
    """Decodes: the leading sequences with one query token."""
    ones = query_lens == 1
    return len(ones) if ones.all() else int(np.argmin(ones))


class StepInputBuffer:
    """Turns StepArrays into the forward's tensors: on CPU by wrapping the arrays (no copy); on an
    accelerator through one persistent pinned int64 buffer and one non-blocking copy."""

    def __init__(self, device: torch.device, block_size: int) -> None:
        self.device = device
        self.block_size = block_size
        self._host = torch.empty(0, dtype=torch.int64)  # pinned on CUDA
        self._copied: torch.cuda.Event | None = None  # the last copy out of _host (CUDA)

    def pack(self, a: StepArrays, sampling: list[Request], out: SchedulerOutput | None = None) -> ForwardBatch:
        num_seqs, num_tokens = len(a.query_lens), len(a.input_ids)
        seq_lens = a.starts + a.query_lens
        query_start = np.zeros(num_seqs + 1, dtype=np.int64)  # offsets of each sequence's tokens
        ends = np.cumsum(a.query_lens, out=query_start[1:])
        if num_tokens == num_seqs:  # all decodes: one token per sequence
            token_seq, positions = np.arange(num_seqs), a.starts
        else:
            token_seq = np.repeat(np.arange(num_seqs), a.query_lens)  # [num_tokens]: its sequence
            positions = a.starts[token_seq] + np.arange(num_tokens) - query_start[token_seq]
        bs = self.block_size
        slots = a.block_table[token_seq, positions // bs] * bs + positions % bs
        parts = (a.input_ids, positions, slots, ends[a.samples] - 1, seq_lens, query_start, a.block_table)
        ids, pos, slot, rows, lens, qsl, table = self._to_device(parts)
        seq_lens_cpu = seq_lens.tolist()
        meta = AttentionMetadata(
            slot_mapping=slot,
            block_tables=table,
            seq_lens=lens.to(torch.int32),
            query_start_loc=qsl.to(torch.int32),
            num_decodes=num_leading_ones(a.query_lens),
            max_seq_len=max(seq_lens_cpu),
            seq_lens_cpu=seq_lens_cpu,
            query_lens_cpu=a.query_lens.tolist(),
            decode_seq_ids=None if a.decode_seq_ids is None else a.decode_seq_ids.tolist(),
        )
        return ForwardBatch(ids, pos, meta, rows, sampling, out, a)

    def _to_device(self, parts: tuple[np.ndarray, ...]) -> list[torch.Tensor]:
        if self.device.type == "cpu":
            return [torch.from_numpy(part) for part in parts]
        if self._copied is not None:  # the previous step's copy must be done before _host is rewritten
            self._copied.synchronize()
        host = self._host_buffer(sum(p.size for p in parts)).numpy()
        offsets = np.cumsum([0] + [p.size for p in parts])
        for part, start in zip(parts, offsets):
            host[start : start + part.size] = part.reshape(-1)
        device = self._host[: offsets[-1]].to(self.device, non_blocking=True)
        if self.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()
        return [device[start : start + p.size].view(p.shape) for p, start in zip(parts, offsets)]

    def _host_buffer(self, size: int) -> torch.Tensor:
        if size > len(self._host):
            pinned = self.device.type == "cuda"
            self._host = torch.empty(max(size, 2 * len(self._host)), dtype=torch.int64, pin_memory=pinned)
        return self._host
