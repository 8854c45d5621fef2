"""The one block-hash function every splitserve process shares (gateway, workers, prefix index).

hash(block) = SHA-256(SEED || parent_hash || token_ids as little-endian uint32 || extra_keys)

- Only full blocks are hashed; a block's hash covers its whole prefix through the parent chain.
- The first block's parent is ROOT_PARENT_HASH, itself derived from the seed.
- extra_keys distinguish blocks with equal tokens but different content (e.g. a LoRA or a
  multimodal input); each key is a str or an int and is length-prefixed so encodings never collide.

Changing anything here changes every hash: bump HASH_VERSION and the pinned values in the tests.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Sequence
from typing import NewType

BlockHash = NewType("BlockHash", bytes)

HASH_VERSION = 1
_SEED = b"splitserve/block-hash/v1"
ROOT_PARENT_HASH = BlockHash(hashlib.sha256(_SEED + b"/root").digest())
HASH_NUM_BYTES = 32


def _encode_extra_keys(extra_keys: Sequence[str | int]) -> bytes:
    parts = []
    for key in extra_keys:
        if isinstance(key, bool) or not isinstance(key, (str, int)):
            raise TypeError(f"extra key must be str or int, got {type(key).__name__}")
        raw = key.encode() if isinstance(key, str) else str(key).encode()
        tag = b"s" if isinstance(key, str) else b"i"
        parts.append(tag + struct.pack("<I", len(raw)) + raw)
    return b"".join(parts)


def hash_block(
    parent_hash: BlockHash | None,
    token_ids: Sequence[int],
    extra_keys: Sequence[str | int] = (),
) -> BlockHash:
    """Hash one full block given its parent's hash (None for the first block)."""
    parent = ROOT_PARENT_HASH if parent_hash is None else parent_hash
    h = hashlib.sha256(_SEED)
    h.update(parent)
    h.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    if extra_keys:
        h.update(_encode_extra_keys(extra_keys))
    return BlockHash(h.digest())


def hash_block_tokens(
    token_ids: Sequence[int],
    block_size: int,
    parent_hash: BlockHash | None = None,
    extra_keys: Sequence[str | int] = (),
) -> list[BlockHash]:
    """Chained hashes of every full block of token_ids (a trailing partial block is skipped)."""
    hashes: list[BlockHash] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent_hash = hash_block(parent_hash, token_ids[start : start + block_size], extra_keys)
        hashes.append(parent_hash)
    return hashes


def extend_block_hashes(
    hashes: list[BlockHash],
    token_ids: Sequence[int],
    block_size: int,
    extra_keys: Iterable[str | int] = (),
) -> None:
    """Append hashes for blocks of token_ids that became full since hashes was last extended."""
    keys = tuple(extra_keys)
    start = len(hashes) * block_size
    parent = hashes[-1] if hashes else None
    hashes.extend(hash_block_tokens(token_ids[start:], block_size, parent, keys))
