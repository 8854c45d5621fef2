"""Who sends which KV heads to whom in a handoff between a prefill tier of one tensor-parallel size and
a decode tier of another (services/engine/ranks.py: each rank's KV cache holds only its KV heads).

The plan is pure: both workers can compute it from three numbers. Every decode rank gets each head it
holds exactly once, from a prefill rank that holds it; where heads are replicated on the prefill side
(more ranks than KV heads) the holders take turns, so that the decode ranks sharing a head read it
from different prefill ranks. Two tiers of size 1 make one piece: rank 0 sends every head to rank 0,
the whole-block transfer.
"""

from __future__ import annotations

from typing import NamedTuple

from splitserve.services.model.parallel import TensorParallel


class Piece(NamedTuple):
    """One slice of every handed-off block: these KV heads, from a prefill rank to a decode rank."""

    src_rank: int  # the prefill worker's rank that sends
    dst_rank: int  # the decode worker's rank that receives
    heads: range  # global KV heads (consecutive)


def heads_of(num_kv_heads: int, size: int, rank: int) -> range:
    """The global KV heads rank holds in a worker of this tensor-parallel size."""
    if not (num_kv_heads % size == 0 or size % num_kv_heads == 0):
        raise ValueError(f"tensor-parallel size {size} neither divides nor is a multiple of {num_kv_heads} KV heads")
    return TensorParallel(rank, size).kv_head_range(num_kv_heads)


def handoff_plan(num_kv_heads: int, src_size: int, dst_size: int) -> list[Piece]:
    """The pieces of a handoff, by decode rank then head; consecutive heads of one pair make one piece."""
    pieces: list[Piece] = []
    for dst in range(dst_size):
        for head in heads_of(num_kv_heads, dst_size, dst):
            src = _holder(num_kv_heads, src_size, dst_size, head, dst)
            last = pieces[-1] if pieces else None
            if last is not None and (last.src_rank, last.dst_rank, last.heads.stop) == (src, dst, head):
                pieces[-1] = Piece(src, dst, range(last.heads.start, head + 1))
            else:
                pieces.append(Piece(src, dst, range(head, head + 1)))
    return pieces


def _holder(num_kv_heads: int, src_size: int, dst_size: int, head: int, dst: int) -> int:
    """The prefill rank that sends head to decode rank dst: the holders of head, in turn over the
    decode ranks that need it."""
    holders = [r for r in range(src_size) if head in heads_of(num_kv_heads, src_size, r)]
    needers = [r for r in range(dst_size) if head in heads_of(num_kv_heads, dst_size, r)]
    return holders[needers.index(dst) % len(holders)]


def check_fits(pieces: list[Piece], num_kv_heads: int, src_size: int, dst_size: int) -> None:
    """Raise ValueError unless every piece comes from a prefill rank that holds its heads and goes to
    a decode rank that holds them (the prefill worker's check of a decode worker's plan)."""
    for p in pieces:
        if not (0 <= p.src_rank < src_size and 0 <= p.dst_rank < dst_size):
            raise ValueError(f"piece {p} names a rank outside sizes {src_size} (prefill) and {dst_size} (decode)")
        for rank, size in ((p.src_rank, src_size), (p.dst_rank, dst_size)):
            held = heads_of(num_kv_heads, size, rank)
            if not (len(p.heads) and held.start <= p.heads.start and p.heads.stop <= held.stop):
                raise ValueError(f"piece {p}: rank {rank} of {size} holds KV heads {held.start}..{held.stop - 1}")
