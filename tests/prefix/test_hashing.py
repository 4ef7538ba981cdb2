"""vLLM-compatible block hashing: known vectors, CBOR, extra keys and the chained-hash
cases of the nanoGPT prefix-caching write-up (character tokens, block size 4)."""

from __future__ import annotations

import hashlib
import pickle

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pd_orchestrator.prefix.hashing import (
    BlockExtras,
    LoraKey,
    VllmBlockHasher,
    cbor_dumps,
    external_hash,
    hash_function,
    resolve_seed,
)
from pd_orchestrator.sim.blocks import BlockPool

# Expected digests of tokens [1, 2, 3, 4] (block size 4) and of the next block
# [5, 6, 7, 8], computed from vLLM's documented algorithm: NONE_HASH = H(seed),
# hash = H((parent or NONE_HASH, tuple(tokens), extra_keys)).
VECTORS = [
    (
        "sha256",
        None,
        "066b1e8987e02713",
        "52a7f141c60918f65779927090482b5a24adbe68c8613a211a1eb4e3edd9361a",
        "bee96bce54f5fcab",
    ),
    (
        "sha256",
        "0",
        "1973e23848344dc4",
        "762b2e7e1520febd3a0aedb7358e8602facf3924440e18538fce057e23bae91d",
        "9e62b5a7ec298f33",
    ),
    (
        "sha256_cbor",
        None,
        "9bd96a485ad84efd",
        "58d0879dff3800f65f8c5fd449d73048c0f7699dd238a03b84b146b151d55111",
        "e1bc29393a2da9fd",
    ),
    (
        "sha256_cbor",
        "0",
        "4e1195df020de59e",
        "c9d58ba695280d69b243e1e0df813136ca9196b286fb1a021e0b2e028ef071cb",
        "24125b23e68883b5",
    ),
]


@pytest.mark.parametrize(
    ("algo", "seed", "none_hash", "first", "second"),
    VECTORS,
    ids=[f"{v[0]}-seed-{v[1]}" for v in VECTORS],
)
def test_known_vectors(
    algo: str, seed: str | None, none_hash: str, first: str, second: str
) -> None:
    hasher = VllmBlockHasher(4, algo, seed)  # type: ignore[arg-type]
    hashes = hasher.block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert hasher.none_hash.hex().startswith(none_hash)
    assert hashes[0].hex() == first
    assert hashes[1].hex().startswith(second)
    assert len(hashes) == 2  # the partial third block has no hash


def test_lora_and_cache_salt_vector() -> None:
    extras = BlockExtras(LoraKey("a", "/p/a"), cache_salt="s")
    digest = VllmBlockHasher(4).block_hashes([1, 2, 3, 4], extras)[0]
    assert digest.hex().startswith("a4e07e4f06f36d5a")


@given(
    tokens=st.lists(st.integers(0, 2**31), min_size=0, max_size=40),
    seed=st.sampled_from([None, "0", "42"]),
)
def test_sha256_is_the_pickled_chain(tokens: list[int], seed: str | None) -> None:
    def h(obj: object) -> bytes:
        return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()

    expected: list[bytes] = []
    parent = h(resolve_seed(seed))
    for start in range(0, len(tokens) - 3, 4):
        parent = h((parent, tuple(tokens[start : start + 4]), None))
        expected.append(parent)
    assert VllmBlockHasher(4, "sha256", seed).block_hashes(tokens) == expected


# RFC 8949, appendix A.
CBOR = [
    (0, "00"),
    (23, "17"),
    (24, "1818"),
    (100, "1864"),
    (1000, "1903e8"),
    (1000000, "1a000f4240"),
    (1000000000000, "1b000000e8d4a51000"),
    (18446744073709551615, "1bffffffffffffffff"),
    (-1, "20"),
    (-100, "3863"),
    (-1000, "3903e7"),
    (b"", "40"),
    (b"\x01\x02\x03\x04", "4401020304"),
    ("", "60"),
    ("a", "6161"),
    ("IETF", "6449455446"),
    ("\u00fc", "62c3bc"),
    ([], "80"),
    ((1, 2, 3), "83010203"),
    ([1, [2, 3], (4, 5)], "8301820203820405"),
    (None, "f6"),
    (True, "f5"),
    (False, "f4"),
]


@pytest.mark.parametrize(("value", "encoded"), CBOR, ids=[e for _, e in CBOR])
def test_cbor_matches_rfc_8949(value: object, encoded: str) -> None:
    assert cbor_dumps(value).hex() == encoded


def test_cbor_refuses_what_it_cannot_encode() -> None:
    with pytest.raises(TypeError):
        cbor_dumps({"a": 1})
    with pytest.raises(ValueError, match="unsupported"):
        hash_function("xxhash")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("value", "key"),
    [
        (5, 5),
        (2**64 + 7, 7),
        (b"\x00" * 24 + b"\x00\x00\x00\x00\x00\x00\x01\x02", 258),
        (b"\x01\x02", 258),
    ],
    ids=["int", "wide-int", "digest", "short-bytes"],
)
def test_external_hash(value: bytes | int, key: int) -> None:
    assert external_hash(value) == key


def test_an_event_int_equals_the_key_of_the_digest() -> None:
    digest = VllmBlockHasher(16).block_hashes(list(range(16)))[0]
    assert external_hash(digest) == int.from_bytes(digest, "big") & (2**64 - 1)


def test_lora_keys_every_block_and_the_salt_only_the_first() -> None:
    extras = BlockExtras(LoraKey("a", "/p/a"), cache_salt="s")
    assert extras.keys(0) == (("lora", "a", "/p/a"), ("cache_salt", "s"))
    assert extras.keys(3) == (("lora", "a", "/p/a"),)
    assert BlockExtras(cache_salt="s").keys(1) is None
    assert BlockExtras().keys(0) is None


def test_different_adapters_and_salts_never_share_a_block() -> None:
    hasher = VllmBlockHasher(4)
    tokens = list(range(16))
    variants = [
        None,
        BlockExtras(LoraKey("a", "/p/a")),
        BlockExtras(LoraKey("b", "/p/b")),
        BlockExtras(LoraKey("a", "/p/a-v2")),
        BlockExtras(cache_salt="tenant-1"),
        BlockExtras(cache_salt="tenant-2"),
    ]
    keys = [set(hasher.keys(tokens, extras)) for extras in variants]
    for i, mine in enumerate(keys):
        for theirs in keys[i + 1 :]:
            assert not mine & theirs


def chars(text: str) -> list[int]:
    return [ord(c) for c in text]


@pytest.fixture(params=["sha256", "sha256_cbor"])
def hasher(request: pytest.FixtureRequest) -> VllmBlockHasher:
    return VllmBlockHasher(4, request.param)


def cached_prefix_tokens(pool: BlockPool, hasher: VllmBlockHasher, tokens: list[int]) -> int:
    return len(pool.longest_hit(hasher.block_hashes(tokens), len(tokens))) * hasher.block_size


def admit(pool: BlockPool, hasher: VllmBlockHasher, tokens: list[int]) -> None:
    hashes = hasher.block_hashes(tokens)
    blocks = pool.allocate(len(hashes))
    pool.cache_blocks(blocks, hashes, 0, len(hashes), tokens)
    pool.free(blocks)


def test_nanogpt_identical_prefixes(hasher: VllmBlockHasher) -> None:
    prompt = chars("To be or not to be")  # 18 tokens: 4 full blocks
    pool = BlockPool(num_blocks=64, block_size=4)
    assert cached_prefix_tokens(pool, hasher, prompt) == 0
    admit(pool, hasher, prompt)
    assert cached_prefix_tokens(pool, hasher, prompt) == 16
    admit(pool, hasher, prompt)
    assert pool.num_cached == 4


def test_nanogpt_shared_prefix_different_suffixes(hasher: VllmBlockHasher) -> None:
    shared = chars("Hello world ")  # 12 tokens: 3 full blocks
    cat, dog = shared + chars("cat"), shared + chars("dog")
    pool = BlockPool(num_blocks=64, block_size=4)
    admit(pool, hasher, cat)
    assert cached_prefix_tokens(pool, hasher, dog) == 12
    admit(pool, hasher, dog)
    assert pool.num_cached == 3


def test_nanogpt_no_shared_prefix(hasher: VllmBlockHasher) -> None:
    first, second = chars("The cat sat on the mat"), chars("Once upon a midnight")
    pool = BlockPool(num_blocks=64, block_size=4)
    admit(pool, hasher, first)
    assert cached_prefix_tokens(pool, hasher, second) == 0
    admit(pool, hasher, second)
    assert pool.num_cached == 10


def test_nanogpt_same_block_after_different_parents(hasher: VllmBlockHasher) -> None:
    """["The", "cat", "sat", "on"] vs ["The", "dog", "sat", "on"], then the same
    ["the", "mat", ".", "!"]: the second blocks differ through their parents."""
    vocab = {w: i for i, w in enumerate(["The", "cat", "dog", "sat", "on", "the", "mat", ".", "!"])}
    a = hasher.block_hashes([vocab[w] for w in "The cat sat on the mat . !".split()])
    b = hasher.block_hashes([vocab[w] for w in "The dog sat on the mat . !".split()])
    assert a[0] != b[0] and a[1] != b[1]


def test_nanogpt_lru_eviction(hasher: VllmBlockHasher) -> None:
    """Three block slots, four blocks cached one after another: the first goes."""
    tokens = chars("The cat sat on the mat and then")
    pool = BlockPool(num_blocks=3, block_size=4)
    hashes = hasher.block_hashes(tokens)[:4]
    for index, block_hash in enumerate(hashes):
        (block,) = pool.allocate(1)
        pool.cache_blocks([block], [block_hash], 0, 1, tokens[index * 4 : index * 4 + 4])
        pool.free([block])
    assert pool.num_cached == 3
    assert not pool.is_cached(hashes[0])
    assert all(pool.is_cached(h) for h in hashes[1:])
