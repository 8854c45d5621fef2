"""Per-request view of the paged KV cache: which blocks a request holds, prefix hits, caching.

The scheduler talks to this class only; it never touches KVBlock lists. The runner gets block ids.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

import numpy as np

from splitserve.common.block_hash import BlockHash
from splitserve.services.engine.kv_cache.block_pool import BlockId, BlockPool, KVBlock
from splitserve.services.engine.kv_cache.block_table import BlockTable


class KVRequest(Protocol):
    """What the manager needs from a request (the engine's Request satisfies it)."""

    num_computed_tokens: int
    all_token_ids: list[int]
    block_hashes: list[BlockHash]

    @property
    def request_id(self) -> str: ...  # read-only here, so the engine's RequestId (a str) fits

    @property
    def num_tokens(self) -> int: ...


class PrefixHit:
    """Cached blocks found for a request's leading full blocks (not yet referenced)."""

    __slots__ = ("blocks", "num_tokens")

    def __init__(self, blocks: list[KVBlock], block_size: int) -> None:
        self.blocks = blocks
        self.num_tokens = len(blocks) * block_size


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_caching: bool = True, max_blocks_per_request: int | None = None
    ) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching)
        self._blocks: dict[str, list[KVBlock]] = {}
        self._num_cached_blocks: dict[str, int] = {}  # leading blocks already registered
        self._parked: dict[str, list[KVBlock]] = {}  # park(): out of their request's hands, not free
        self._table = BlockTable(min(max_blocks_per_request or num_blocks, num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def find_prefix_hit(self, request: KVRequest) -> PrefixHit:
        """Longest cached run of the request's leading full blocks, leaving >= 1 token to compute."""
        if not self.pool.enable_caching:
            return PrefixHit([], self.block_size)
        max_blocks = (request.num_tokens - 1) // self.block_size
        tokens, bs = request.all_token_ids, self.block_size
        hits: list[KVBlock] = []
        for i, block_hash in enumerate(request.block_hashes[:max_blocks]):
            block = self.pool.lookup(block_hash, tokens[i * bs : (i + 1) * bs])
            if block is None:
                break
            hits.append(block)
        return PrefixHit(hits, self.block_size)

    def allocate_slots(
        self, request: KVRequest, num_new_tokens: int, hit: PrefixHit | None = None, num_keep_free: int = 0
    ) -> bool:
        """Make room for num_new_tokens more tokens (after the prefix hit, if any).

        Returns False, changing nothing, when the pool cannot supply the blocks and still have
        num_keep_free blocks free afterwards.
        """
        hit_blocks = hit.blocks if hit else []
        blocks = self._blocks.get(request.request_id, [])
        num_computed = request.num_computed_tokens + len(hit_blocks) * self.block_size
        num_needed = cdiv(num_computed + num_new_tokens, self.block_size)
        num_new_blocks = max(0, num_needed - len(blocks) - len(hit_blocks))
        num_hits_in_free_queue = sum(1 for block in hit_blocks if block.ref_cnt == 0)
        if num_new_blocks + num_hits_in_free_queue + num_keep_free > self.pool.num_free_blocks:
            return False
        self.pool.touch(hit_blocks)
        new_blocks = hit_blocks + self.pool.allocate(num_new_blocks)
        self._blocks.setdefault(request.request_id, blocks).extend(new_blocks)
        if new_blocks or not blocks:
            self._table.append(request.request_id, [block.block_id for block in new_blocks])
        if hit_blocks:
            self._num_cached_blocks[request.request_id] = len(hit_blocks)
        return True

    def allocate_next_blocks(self, requests: Sequence[KVRequest]) -> bool:
        """One more block for each request whose blocks are full (decodes whose next token starts a
        block), all or none. False, changing nothing, when the pool has too few free blocks."""
        bs = self.block_size
        full = [r for r in requests if len(self._blocks[r.request_id]) * bs <= r.num_computed_tokens]
        if len(full) > self.pool.num_free_blocks:
            return False
        for request, block in zip(full, self.pool.allocate(len(full))):
            self._blocks[request.request_id].append(block)
            self._table.append(request.request_id, [block.block_id])
        return True

    def cache_blocks(self, request: KVRequest) -> None:
        """Register the request's blocks that are full and computed as prefix cache."""
        rid, bs = request.request_id, self.block_size
        start = self._num_cached_blocks.get(rid, 0)
        end = min(request.num_computed_tokens // bs, len(request.block_hashes))
        if end <= start:
            return
        blocks = self._blocks[rid][start:end]
        hashes = request.block_hashes[start:end]
        parent = request.block_hashes[start - 1] if start else None
        self.pool.cache_full_blocks(blocks, hashes, request.all_token_ids[start * bs : end * bs], parent, bs)
        self._num_cached_blocks[rid] = end

    def free(self, request: KVRequest) -> None:
        """Release every block of the request, tail first so chain tails are evicted first."""
        self.pool.free(reversed(self._take(request.request_id)))

    def park(self, request: KVRequest) -> None:
        """Take every block of the request out of its hands but not back to the pool: a transfer may
        still be writing them (the request may allocate new ones meanwhile). free_parked ends it."""
        self._parked[request.request_id] = self._take(request.request_id)

    def free_parked(self, request_id: str) -> None:
        """Back to the pool, tail first: the blocks park() took (none: nothing to do)."""
        self.pool.free(reversed(self._parked.pop(request_id, [])))

    def is_parked(self, request_id: str) -> bool:
        return request_id in self._parked

    @property
    def num_parked(self) -> int:
        """Requests whose blocks are parked."""
        return len(self._parked)

    def _take(self, request_id: str) -> list[KVBlock]:
        blocks = self._blocks.pop(request_id, [])
        self._num_cached_blocks.pop(request_id, None)
        self._table.remove(request_id)
        return blocks

    def block_ids(self, request_id: str) -> list[BlockId]:
        return [block.block_id for block in self._blocks.get(request_id, ())]

    def block_table(self, request_ids: Iterable[str]) -> np.ndarray:
        """[n, most blocks of any of them] int64: each request's block ids, padded with block 0."""
        return self._table.gather(self._table.rows(request_ids))

    def num_blocks_of(self, request_id: str) -> int:
        return len(self._blocks.get(request_id, ()))

    def holds(self, request_id: str) -> bool:
        return request_id in self._blocks
