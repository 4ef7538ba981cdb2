"""Chained block hashes and the block pool."""

from __future__ import annotations

import pytest

from pd_orchestrator.prefix.hashing import BlockExtras, LoraKey
from pd_orchestrator.sim.blocks import (
    BlockHasher,
    BlockPool,
    BlockRemoved,
    BlockStored,
    NoFreeBlocks,
)


def test_only_full_blocks_get_a_hash() -> None:
    hasher = BlockHasher(4)
    assert len(hasher.extend([], list(range(11)))) == 2


def test_same_block_tokens_after_different_parents_hash_differently() -> None:
    hasher = BlockHasher(4)
    a = hasher.extend([], [1, 2, 3, 4, 9, 9, 9, 9])
    b = hasher.extend([], [5, 6, 7, 8, 9, 9, 9, 9])
    assert a[1] != b[1]
    assert hasher.extend([], [1, 2, 3, 4, 7, 7, 7, 7])[0] == a[0]


def test_extend_continues_the_chain() -> None:
    hasher = BlockHasher(4)
    tokens = list(range(16))
    assert hasher.extend(hasher.extend([], tokens[:9]), tokens) == hasher.extend([], tokens)


def test_hash_seed_and_extra_keys_separate_the_hash_spaces() -> None:
    tokens = list(range(4))
    assert BlockHasher(4, "0").extend([], tokens) != BlockHasher(4, "1").extend([], tokens)
    hasher = BlockHasher(4)
    lora_a = BlockExtras(LoraKey("a", "/adapters/a"))
    lora_b = BlockExtras(LoraKey("b", "/adapters/b"))
    assert hasher.extend([], tokens, lora_a) != hasher.extend([], tokens, lora_b)


def test_hasher_defaults_follow_vllm() -> None:
    """No seed means vLLM's fixed seed for sha256; the algorithm is selectable."""
    assert BlockHasher(4).none_hash == BlockHasher(4, "vllm-none-hash").none_hash
    assert BlockHasher(4, algo="sha256_cbor").none_hash != BlockHasher(4).none_hash


def test_stored_events_carry_the_lora_name_and_the_untagged_extra_keys() -> None:
    pool = BlockPool(num_blocks=2, block_size=4, record_events=True)
    extras = BlockExtras(LoraKey("a", "/adapters/a"), cache_salt="tenant")
    hashes = BlockHasher(4).extend([], list(range(8)), extras)
    pool.cache_blocks(pool.allocate(2), hashes, 0, 2, list(range(8)), extras)
    (stored,) = pool.events
    assert isinstance(stored, BlockStored) and stored.lora_name == "a"
    assert stored.extra_keys == [("a", "tenant"), ("a",)]


def test_pool_records_stored_and_removed_events() -> None:
    pool = BlockPool(num_blocks=2, block_size=4, record_events=True)
    hashes = BlockHasher(4).extend([], list(range(8)))
    blocks = pool.allocate(2)
    pool.cache_blocks(blocks, hashes, 0, 2, list(range(8)))
    pool.free(blocks)
    pool.allocate(1)
    stored, removed = pool.events
    assert isinstance(stored, BlockStored) and stored.block_hashes == hashes
    assert stored.token_ids == list(range(8)) and stored.parent_block_hash is None
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == [hashes[1]]


def test_pool_refuses_more_blocks_than_free() -> None:
    pool = BlockPool(num_blocks=2, block_size=4)
    pool.allocate(2)
    with pytest.raises(NoFreeBlocks):
        pool.allocate(1)
