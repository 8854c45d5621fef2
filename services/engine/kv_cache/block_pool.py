"""The block pool: sole owner of every KV block's ref count, hash and place in the free queue.

Free blocks sit in an LRU queue (least recently freed at the head). A freed block keeps its hash
and stays findable as prefix cache until it reaches the head and is allocated again (lazy
eviction). Callers free a request's blocks in reverse order, so a chain's tail is evicted first.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NewType

from splitserve.common.block_hash import BlockHash
from splitserve.common.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)

BlockId = NewType("BlockId", int)


class KVBlock:
    """One KV block's metadata. Only the BlockPool writes these fields."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "token_ids", "prev_free", "next_free")

    def __init__(self, block_id: BlockId) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.token_ids: tuple[int, ...] | None = None  # kept to verify a hash hit
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    def __repr__(self) -> str:
        return f"KVBlock(id={self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class FreeBlockQueue:
    """Doubly linked list of free blocks with sentinel head and tail: O(1) pop, append, remove."""

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self._head = KVBlock(BlockId(-1))  # sentinels, never handed out
        self._tail = KVBlock(BlockId(-1))
        self._head.next_free, self._tail.prev_free = self._tail, self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise RuntimeError("no free KV block")
        self.remove(block)
        return block

    def append(self, block: KVBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        block.prev_free, block.next_free = last, self._tail
        last.next_free = block
        self._tail.prev_free = block
        self.num_free += 1

    def remove(self, block: KVBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise RuntimeError(f"{block} is not in the free queue")
        prev.next_free, nxt.prev_free = nxt, prev
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def __iter__(self):
        block = self._head.next_free
        while block is not self._tail and block is not None:
            yield block
            block = block.next_free


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(BlockId(i)) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self._cached: dict[BlockHash, KVBlock] = {}
        self._events: list[KVCacheEvent] = []

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.free_queue.num_free

    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def lookup(self, block_hash: BlockHash, token_ids: Sequence[int]) -> KVBlock | None:
        """The cached block for block_hash, if its tokens really match (guards hash collisions)."""
        block = self._cached.get(block_hash)
        if block is None or block.token_ids != tuple(token_ids):
            return None
        return block

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on cache-hit blocks, pulling free ones out of the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def allocate(self, num_blocks: int) -> list[KVBlock]:
        if num_blocks > self.free_queue.num_free:
            raise RuntimeError(f"asked for {num_blocks} KV blocks, {self.free_queue.num_free} free")
        blocks = [self.free_queue.popleft() for _ in range(num_blocks)]
        evicted = [h for h in map(self._evict, blocks) if h is not None]
        if evicted:
            self._events.append(BlockRemoved(tuple(evicted)))
        for block in blocks:
            block.ref_cnt = 1
        return blocks

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference each; pass a request's blocks in reverse order (tail first)."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def cache_full_blocks(
        self,
        blocks: Sequence[KVBlock],
        block_hashes: Sequence[BlockHash],
        token_ids: Sequence[int],
        parent_hash: BlockHash | None,
        block_size: int,
    ) -> None:
        """Register newly filled blocks (their KV is computed) as prefix cache and emit BlockStored.

        blocks[i] holds token_ids[i*block_size:(i+1)*block_size] and has hash block_hashes[i].
        A hash already cached by another block is left alone (the duplicate block stays private).
        """
        if not self.enable_caching or not blocks:
            return
        runs: list[list[int]] = []  # contiguous runs of newly stored block indices
        for i, (block, block_hash) in enumerate(zip(blocks, block_hashes, strict=True)):
            if block.block_hash is not None or block_hash in self._cached:
                continue
            block.block_hash = block_hash
            block.token_ids = tuple(token_ids[i * block_size : (i + 1) * block_size])
            self._cached[block_hash] = block
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        for run in runs:
            first, end = run[0], run[-1] + 1
            parent = parent_hash if first == 0 else block_hashes[first - 1]
            tokens = tuple(token_ids[first * block_size : end * block_size])
            self._events.append(BlockStored(tuple(block_hashes[first:end]), parent, tokens, block_size))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible when no block is in use."""
        if self.num_used_blocks:
            return False
        for block in self.blocks:
            self._evict(block)
        self._events.append(AllBlocksCleared())
        return True

    def drain_events(self) -> list[KVCacheEvent]:
        events, self._events = self._events, []
        return events

    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def cached_hashes(self) -> list[BlockHash]:
        """Every hash that resolves on this pool now (a snapshot for the prefix index)."""
        return list(self._cached)

    def _evict(self, block: KVBlock) -> BlockHash | None:
        block_hash = block.block_hash
        if block_hash is None:
            return None
        del self._cached[block_hash]
        block.block_hash = None
        block.token_ids = None
        return block_hash
