"""KV cache events emitted by the block pool; the prefix index (a later issue) consumes them."""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.common.block_hash import BlockHash


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Full blocks became reusable prefix cache. parent_hash is None for a chain's first block."""

    block_hashes: tuple[BlockHash, ...]
    parent_hash: BlockHash | None
    token_ids: tuple[int, ...]  # all tokens of the stored blocks, in order
    block_size: int


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Cached blocks were evicted and their hashes no longer resolve on this worker."""

    block_hashes: tuple[BlockHash, ...]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The whole prefix cache was reset."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
