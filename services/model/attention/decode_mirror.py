"""Contiguous copies of the decoding sequences' K/V, kept from step to step: how the CPU path's decode
attention avoids gathering every sequence's whole context in every layer of every step.

The paged cache scatters a sequence's context over blocks, and within a block one head's K rows sit
num_kv_heads * head_dim apart. Through the paged path a decode step gathers each sequence's blocks per
layer (the bytes transformers' DynamicCache copies with torch.cat), then SDPA's flash kernel reads the
strided rows, ~1.5x slower than contiguous ones. Here each decoding sequence owns a slot of a per-layer
buffer [2, slots, num_kv_heads, capacity, head_dim], its context contiguous per head: a step writes one
new token per slot and SDPA reads the slots where they lie.

A slot's life, keyed by the sequence's id (AttentionMetadata.decode_seq_ids, unique in the process):
    filled    at the sequence's first decode step: its context gathered from the paged cache
    appended  at each next step: the new token's K/V written at its position
    freed     at a step whose decodes lack it, or where its length did not grow by exactly one
              (preempted and recomputed): the paged cache, always written first, stays the truth
Slots stay packed in 0..num_decodes-1 (a kept sequence above moves down into a freed slot: one row
copy), so SDPA reads the buffer's leading slots and the queries are permuted into slot order. SDPA
runs per range of consecutive slots of similar length, each at its own width (padding every slot to
the batch's longest context cost ~1.2x the paged path, which groups by length, on mixed batches);
when the slots' order has drifted so far from the lengths' that the ranges pad 25% more than sorted
ones would, every slot is reassigned in length order (the kept copies permuted once). Contexts all
grow by one per step, so kept sequences stay in order; only joins disturb it.

Each layer's buffer records the step it last applied. One that missed a step (the step failed between
layers, or the buffer is new) refills every slot from the paged cache: a copy never outlives the steps
it followed. Memory: at most `budget_bytes` per layer (None: the size of the layer's paged cache, so
at most x2 of the cache in all); a step that would need more attends through the paged gather. The
buffers go once a step has no decodes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from splitserve.services.model.attention.backend import AttentionMetadata
from splitserve.services.model.attention.cache_ops import additive_mask, gather_kv


@dataclass(frozen=True, slots=True)
class _Fill:
    """Sequences whose slots are written from the paged cache."""

    rows: torch.Tensor  # [n]: their decode rows
    slots: torch.Tensor  # [n]
    block_ids: torch.Tensor  # [n * num_blocks]: each sequence's first num_blocks blocks
    num_blocks: int


@dataclass(frozen=True, slots=True)
class _Moves:
    """Kept sequences whose slot changes: src -> dst, their first `width` positions (all they hold)."""

    src: torch.Tensor  # [m]
    dst: torch.Tensor  # [m]
    width: int


class SlotRange(NamedTuple):
    """Slots attended together, at their longest length."""

    start: int
    stop: int
    width: int
    mask: torch.Tensor | None  # [stop - start, 1, 1, width] 0 / -inf; None: every slot full length


@dataclass(frozen=True, slots=True)
class MirrorStep:
    """One step's slot plan, shared by its layers."""

    serial: int
    carried_from: int | None  # the step whose slots this one keeps; None: every slot is filled
    shape: tuple[int, int]  # (slots, capacity) of every layer's buffer in this step
    width: int  # the longest context
    moves: _Moves | None  # read before anything is written
    fill: _Fill | None  # the new sequences (when carried)
    refill: _Fill  # every sequence (a layer that missed the carried step)
    append_rows: torch.Tensor  # [a]: decode rows appended (the kept ones)
    append_index: torch.Tensor  # [a * num_kv_heads]: their new token's flat row in a buffer half
    row_of_slot: torch.Tensor | None  # [num_decodes]: the decode row in each slot; None: the same order
    slot_of_row: torch.Tensor | None  # [num_decodes]: its inverse
    ranges: list[SlotRange]  # covering 0..num_decodes-1 in order


@dataclass(slots=True)
class _Buffer:
    data: torch.Tensor  # [2, slots, num_kv_heads, capacity, head_dim]
    applied: int | None  # the serial of the last step written into it


class DecodeMirror:
    def __init__(self, num_kv_heads: int, head_dim: int, block_size: int, budget_bytes: int | None) -> None:
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.block_size = block_size
        self.budget_bytes = budget_bytes
        self._slots: dict[int, tuple[int, int]] = {}  # seq id -> (slot, tokens held) after the last step
        self._serial = 0
        self._last: int | None = None  # serial of the last step planned with slots
        self._shape = (0, 0)
        self._buffers: dict[int, _Buffer] = {}  # by the layer's kv_cache data_ptr

    # -- once per step (its first layer) --------------------------------------------------------------
    def plan(self, meta: AttentionMetadata, layer_bytes: int, dtype: torch.dtype) -> MirrorStep | None:
        """The step's slot plan; None: its decodes go through the paged gather (and the slots are
        forgotten: nothing carried to a later step)."""
        nd, ids = meta.num_decodes, meta.decode_seq_ids
        if nd == 0:
            self._buffers.clear()
        if not nd or ids is None or (shape := self._fit(meta, layer_bytes, dtype)) is None:
            self._slots, self._last = {}, None
            return None
        lens = meta.seq_lens_cpu[:nd]
        slot_of_row, kept = self._assign(ids, lens)
        old = self._slots
        moves = [
            (old[i][0], slot, n - 1) for i, slot, n, k in zip(ids, slot_of_row, lens, kept) if k and old[i][0] != slot
        ]
        self._serial += 1
        carried_from, self._last, self._shape = self._last, self._serial, shape
        self._slots = {sid: (slot, n) for sid, slot, n in zip(ids, slot_of_row, lens)}
        return self._step(meta, carried_from, shape, slot_of_row, moves, kept, dtype)

    def _fit(self, meta: AttentionMetadata, layer_bytes: int, dtype: torch.dtype) -> tuple[int, int] | None:
        """(slots, capacity) for this step: doubled from the last step's when it needs more, or as much
        room as the budget allows beyond what it needs; None: not even that fits. Each growth is a new
        buffer per layer and a copy of the old (fresh pages: ~50 ms per layer at 64 slots of 1k tokens
        on the 2-core VM), so headroom matters more than a tight fit."""
        bs, nd = self.block_size, meta.num_decodes
        need = -(-max(meta.seq_lens_cpu[:nd]) // bs) * bs  # fills write whole blocks
        slots, capacity = self._shape
        if nd <= slots and need <= capacity:
            return self._shape
        per_token = 2 * self.num_kv_heads * self.head_dim * torch.empty((), dtype=dtype).element_size()
        budget_tokens = (layer_bytes if self.budget_bytes is None else self.budget_bytes) // per_token
        slots = slots if nd <= slots else max(nd, -(-slots * 2 // 8) * 8)
        if slots * need > budget_tokens:
            slots = nd
        if slots * need > budget_tokens:
            return None
        grown = capacity if need <= capacity else max(need, capacity * 2)
        return slots, min(grown, budget_tokens // slots // bs * bs)  # >= need: need is whole blocks

    def _assign(self, ids: list[int], lens: list[int]) -> tuple[list[int], list[bool]]:
        """Each decode row's slot (packed in 0..n-1), and which rows keep their copies. Kept slots stay
        where they are (those past n move down into freed ones), unless lengths have got so mixed up
        along the slots that attending slot ranges would pad 25% more than in length order: then every
        slot is reassigned by length (one copy of the kept rows, about one step's gather)."""
        n, old = len(ids), self._slots
        kept = [(sid in old and old[sid][1] == length - 1) for sid, length in zip(ids, lens)]
        taken = {old[sid][0] for sid, keep in zip(ids, kept) if keep and old[sid][0] < n}
        free = iter(s for s in range(n) if s not in taken)
        slot_of_row = [old[sid][0] if keep else -1 for sid, keep in zip(ids, kept)]
        for row, slot in enumerate(slot_of_row):
            if slot < 0 or slot >= n:
                slot_of_row[row] = next(free)
        slot_lens = [0] * n
        for row, slot in enumerate(slot_of_row):
            slot_lens[slot] = lens[row]
        by_length = sorted(lens)
        if padded_tokens(slot_lens) > 1.25 * padded_tokens(by_length):
            for slot, row in enumerate(sorted(range(n), key=lens.__getitem__)):
                slot_of_row[row] = slot
        return slot_of_row, kept

    def _step(
        self,
        meta: AttentionMetadata,
        carried_from: int | None,
        shape: tuple[int, int],
        slot_of_row: list[int],
        moves: list[tuple[int, int, int]],  # (from slot, to slot, tokens held)
        kept: list[bool],
        dtype: torch.dtype,
    ) -> MirrorStep:
        nd, device = meta.num_decodes, meta.block_tables.device
        lens = meta.seq_lens_cpu[:nd]
        slot_t = torch.tensor(slot_of_row, device=device)
        identity = slot_of_row == list(range(nd))
        row_of_slot = None if identity else torch.empty_like(slot_t).scatter_(0, slot_t, torch.arange(nd))
        seq_lens = meta.seq_lens[:nd] if row_of_slot is None else meta.seq_lens[:nd][row_of_slot]
        slot_lens = seq_lens.tolist()
        ranges = [_range(a, b, slot_lens, seq_lens, dtype) for a, b in slot_ranges(slot_lens)]
        rows = [r for r in range(nd) if kept[r]]
        kvh, capacity = self.num_kv_heads, shape[1]
        heads = torch.arange(kvh, device=device)
        append_rows = torch.tensor(rows, dtype=torch.int64, device=device)
        positions = torch.tensor([lens[r] - 1 for r in rows], dtype=torch.int64, device=device)
        append_index = ((slot_t[append_rows][:, None] * kvh + heads) * capacity + positions[:, None]).flatten()
        fresh = [r for r in range(nd) if not kept[r]]
        fill = self._fill(meta, fresh, slot_t) if carried_from is not None and fresh else None
        return MirrorStep(
            serial=self._serial,
            carried_from=carried_from,
            shape=shape,
            width=max(lens),
            moves=_moves(moves, device),
            fill=fill,
            refill=self._fill(meta, list(range(nd)), slot_t),
            append_rows=append_rows,
            append_index=append_index,
            row_of_slot=row_of_slot,
            slot_of_row=None if identity else slot_t,
            ranges=ranges,
        )

    def _fill(self, meta: AttentionMetadata, rows: list[int], slot_of_row: torch.Tensor) -> _Fill:
        num_blocks = -(-max(meta.seq_lens_cpu[r] for r in rows) // self.block_size)
        rows_t = torch.tensor(rows, dtype=torch.int64, device=slot_of_row.device)
        return _Fill(rows_t, slot_of_row[rows_t], meta.block_tables[rows_t, :num_blocks].flatten(), num_blocks)

    # -- every layer ---------------------------------------------------------------------------------
    def update(
        self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, step: MirrorStep
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Bring this layer's copies to the step (kv_cache already holds its new K/V); returns its keys
        and values in slot order, [num_decodes, num_kv_heads, width, head_dim] each. k, v: the decodes'
        new K/V, [num_decodes, num_kv_heads, head_dim]."""
        buffer = self._buffers.get(kv_cache.data_ptr())
        carried = buffer is not None and step.carried_from is not None and buffer.applied == step.carried_from
        moves, moved = step.moves, None
        if carried and moves is not None:  # read before the resize: a source may lie past the new slots
            assert buffer is not None
            moved = buffer.data[:, moves.src, :, : moves.width]  # a copy (advanced indexing)
        data = self._resized(buffer, carried, step.shape, kv_cache)
        if moves is not None and moved is not None:
            data[:, moves.dst, :, : moves.width] = moved
        self._buffers[kv_cache.data_ptr()] = _Buffer(data, step.serial)
        if carried:
            if len(step.append_rows):
                halves = data.view(2, -1, self.head_dim)
                halves[0].index_copy_(0, step.append_index, k[step.append_rows].flatten(0, 1))
                halves[1].index_copy_(0, step.append_index, v[step.append_rows].flatten(0, 1))
            fill = step.fill
        else:
            fill = step.refill
        if fill is not None:
            self._write_fill(data, kv_cache, fill)
        nd = len(k)
        return data[0, :nd, :, : step.width], data[1, :nd, :, : step.width]

    def _resized(
        self, buffer: _Buffer | None, keep: bool, shape: tuple[int, int], kv_cache: torch.Tensor
    ) -> torch.Tensor:
        if buffer is not None and buffer.data.shape[1] == shape[0] and buffer.data.shape[3] == shape[1]:
            return buffer.data
        # Zeros, not new_empty: SDPA masks a slot's positions past its length by adding -inf to their
        # scores, which leaves a NaN there (and 0 * NaN from V) NaN: what is never written must be finite.
        data = kv_cache.new_zeros(2, shape[0], self.num_kv_heads, shape[1], self.head_dim)
        if buffer is not None and keep:
            slots, capacity = min(shape[0], buffer.data.shape[1]), min(shape[1], buffer.data.shape[3])
            data[:, :slots, :, :capacity] = buffer.data[:, :slots, :, :capacity]
        return data

    def _write_fill(self, data: torch.Tensor, kv_cache: torch.Tensor, fill: _Fill) -> None:
        width = fill.num_blocks * self.block_size
        context = gather_kv(kv_cache, fill.block_ids)  # [2, n * width, kvh, d]
        data[:, fill.slots, :, :width] = context.view(2, len(fill.rows), width, *context.shape[2:]).transpose(2, 3)


def slot_ranges(lens: list[int], ratio: float = 1.5, min_size: int = 8) -> list[tuple[int, int]]:
    """Runs of consecutive slots attended together (lens: each slot's length): a run closes once it
    has min_size slots and the next length would take its longest past ratio x its shortest."""
    ranges, start, low, high = [], 0, lens[0], lens[0]
    for slot in range(1, len(lens)):
        n = lens[slot]
        if slot - start >= min_size and max(high, n) > ratio * min(low, n):
            ranges.append((start, slot))
            start, low, high = slot, n, n
        low, high = min(low, n), max(high, n)
    ranges.append((start, len(lens)))
    return ranges


def padded_tokens(lens: list[int]) -> int:
    """Keys attended over slot_ranges(lens), each range padded to its longest."""
    return sum((b - a) * max(lens[a:b]) for a, b in slot_ranges(lens))


def _range(start: int, stop: int, slot_lens: list[int], seq_lens: torch.Tensor, dtype: torch.dtype) -> SlotRange:
    width = max(slot_lens[start:stop])
    if min(slot_lens[start:stop]) == width:
        return SlotRange(start, stop, width, None)
    visible = torch.arange(width, device=seq_lens.device)[None, :] < seq_lens[start:stop, None]
    return SlotRange(start, stop, width, additive_mask(visible, dtype)[:, None, None, :])


def _moves(moves: list[tuple[int, int, int]], device: torch.device) -> _Moves | None:
    if not moves:
        return None
    src, dst, held = zip(*moves)
    return _Moves(torch.tensor(src, device=device), torch.tensor(dst, device=device), max(held))
