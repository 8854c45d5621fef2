"""The shared block hash: pinned values, cross-process stability, chaining, partial blocks."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from splitserve.common.block_hash import (
    HASH_NUM_BYTES,
    HASH_VERSION,
    ROOT_PARENT_HASH,
    BlockHash,
    extend_block_hashes,
    hash_block,
    hash_block_tokens,
)

# Pinned for HASH_VERSION 1. If these change, every stored prefix index and every peer process
# disagrees: bump HASH_VERSION and update these values together, on purpose.
PINNED_ROOT = "497a6cfb16084b5b87e4d2fec5347c5904aca9f75e2925731189349704c1fedf"
PINNED_FIRST = "2d78e92666a259bdcdf5fbc895f9b389162c5d3880c0af778fbb55322489890d"  # [1, 2, 3, 4]
PINNED_SECOND = "b3d4c849e3ffee1d8eb5b06dc91ece32a5e615bc7f85097460f3339d23239551"  # then [5, 6, 7, 8]
PINNED_EXTRA = "4afe1e567be865a50b59e1d15996e30025c3652ccbd33b77b9714b8326fe028c"  # [1..4], ("lora-a", 7)


def test_hash_version_matches_pinned_values():
    assert HASH_VERSION == 1


def test_root_parent_hash_is_pinned():
    assert ROOT_PARENT_HASH.hex() == PINNED_ROOT


def test_first_block_hash_is_pinned():
    h = hash_block(None, [1, 2, 3, 4])
    assert isinstance(h, bytes) and len(h) == HASH_NUM_BYTES
    assert h.hex() == PINNED_FIRST


def test_chained_block_hash_is_pinned():
    first = hash_block(None, [1, 2, 3, 4])
    assert hash_block(first, [5, 6, 7, 8]).hex() == PINNED_SECOND


def test_extra_keys_hash_is_pinned():
    assert hash_block(None, [1, 2, 3, 4], ("lora-a", 7)).hex() == PINNED_EXTRA


def test_explicit_root_parent_equals_none_parent():
    assert hash_block(ROOT_PARENT_HASH, [1, 2, 3, 4]) == hash_block(None, [1, 2, 3, 4])


def test_hash_is_the_same_in_a_fresh_process():
    # A fresh interpreter gets a different PYTHONHASHSEED; the block hash must not depend on it.
    code = (
        "from splitserve.common.block_hash import hash_block, hash_block_tokens\n"
        "first = hash_block(None, [1, 2, 3, 4])\n"
        "print(first.hex())\n"
        "print(hash_block(first, [5, 6, 7, 8]).hex())\n"
        "print(hash_block(None, [1, 2, 3, 4], ('lora-a', 7)).hex())\n"
        "print(','.join(h.hex() for h in hash_block_tokens(list(range(100, 130)), 8)))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONHASHSEED": "12345"},
        check=True,
    )
    lines = result.stdout.split()
    expected_chain = ",".join(h.hex() for h in hash_block_tokens(list(range(100, 130)), 8))
    assert lines == [PINNED_FIRST, PINNED_SECOND, PINNED_EXTRA, expected_chain]


def test_trailing_partial_block_is_skipped():
    tokens = list(range(11))
    hashes = hash_block_tokens(tokens, 4)
    assert len(hashes) == 2
    assert hashes == hash_block_tokens(tokens[:8], 4)
    assert hash_block_tokens(tokens[:3], 4) == []
    assert len(hash_block_tokens(tokens[:12] + [0], 4)) == 3


def test_hash_block_tokens_chains_through_parents():
    tokens = [9, 8, 7, 6, 5, 4, 3, 2]
    first = hash_block(None, tokens[:4])
    assert hash_block_tokens(tokens, 4) == [first, hash_block(first, tokens[4:])]


def test_different_parent_gives_different_hash():
    block = [5, 6, 7, 8]
    a = hash_block_tokens([1, 2, 3, 4] + block, 4)
    b = hash_block_tokens([1, 2, 3, 0] + block, 4)
    assert a[0] != b[0]
    assert a[1] != b[1]  # same tokens, different prefix
    assert hash_block(None, block) != a[1]


def test_token_order_and_values_matter():
    assert hash_block(None, [1, 2, 3, 4]) != hash_block(None, [4, 3, 2, 1])
    assert hash_block(None, [1, 2, 3, 4]) != hash_block(None, [1, 2, 3, 5])
    # Little-endian uint32 per token: a large id is not confused with two small ones.
    assert hash_block(None, [1, 0]) != hash_block(None, [256, 0])


def test_extra_keys_distinguish_blocks():
    base = hash_block(None, [1, 2, 3, 4])
    assert hash_block(None, [1, 2, 3, 4], ("lora-a",)) != base
    assert hash_block(None, [1, 2, 3, 4], ("lora-a",)) != hash_block(None, [1, 2, 3, 4], ("lora-b",))
    # Length-prefixed and type-tagged: neither concatenation nor str/int can collide.
    assert hash_block(None, [1], ("ab",)) != hash_block(None, [1], ("a", "b"))
    assert hash_block(None, [1], ("7",)) != hash_block(None, [1], (7,))
    assert hash_block(None, [1], ("lora-a", 7)) != hash_block(None, [1], (7, "lora-a"))


@pytest.mark.parametrize("bad_key", [True, 1.5, b"x", None])
def test_bad_extra_key_type_raises(bad_key):
    with pytest.raises(TypeError, match="extra key must be str or int"):
        hash_block(None, [1, 2], ("ok", bad_key))


def test_extend_block_hashes_incremental_equals_one_shot():
    tokens = [(i * 7919) % 50 for i in range(37)]
    one_shot = hash_block_tokens(tokens, 4)
    hashes: list[BlockHash] = []
    for n in range(len(tokens) + 1):  # one token at a time, as decoding appends them
        extend_block_hashes(hashes, tokens[:n], 4)
        assert hashes == one_shot[: n // 4]
    assert hashes == one_shot and len(hashes) == 9


def test_extend_block_hashes_in_uneven_chunks_with_extra_keys():
    tokens = list(range(40))
    keys = ("lora-a", 7)
    one_shot = hash_block_tokens(tokens, 8, extra_keys=keys)
    hashes: list[BlockHash] = []
    for n in (3, 8, 9, 9, 23, 40, 40):
        extend_block_hashes(hashes, tokens[:n], 8, iter(keys))
    assert hashes == one_shot
    assert hashes != hash_block_tokens(tokens, 8)
