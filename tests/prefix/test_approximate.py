"""The approximate character-chunk prefix cache."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from pd_orchestrator.prefix.approximate import ApproximatePrefixCache, namespace

SYSTEM = "You are a helpful assistant for the billing team. " * 8  # 400 characters


def test_only_full_chunks_have_keys() -> None:
    cache = ApproximatePrefixCache(chunk_chars=64)
    assert len(cache.keys("x" * 63)) == 0
    assert len(cache.keys("x" * 200)) == 3


def test_keys_chain_on_the_whole_prefix() -> None:
    cache = ApproximatePrefixCache(chunk_chars=4)
    a, b = cache.keys("abcdWXYZ"), cache.keys("abceWXYZ")
    assert a[0] != b[0] and a[1] != b[1]
    assert cache.keys("abcdWXYZtail")[:2] == a


def test_namespaces_never_share_keys() -> None:
    cache = ApproximatePrefixCache()
    spaces = [
        namespace("m", None, None),
        namespace("m", "sql", None),
        namespace("m", None, "tenant"),
        namespace("other", None, None),
    ]
    keys = [set(cache.keys(SYSTEM, space)) for space in spaces]
    assert all(not keys[i] & keys[j] for i in range(4) for j in range(i + 1, 4))


def test_recorded_routes_match_the_longest_prefix() -> None:
    cache = ApproximatePrefixCache()
    cache.record(cache.keys(SYSTEM + "question one"), "a")
    cache.record(cache.keys(SYSTEM[:128]), "b")
    matched = cache.match(cache.keys(SYSTEM + "another question"), ["a", "b", "c"])
    assert matched == {"a": len(SYSTEM) // 64, "b": 2, "c": 0}


def test_capacity_forgets_the_least_recently_routed() -> None:
    cache = ApproximatePrefixCache(chunk_chars=8, capacity_per_endpoint=4)
    old, new = cache.keys("o" * 32), cache.keys("n" * 32)
    cache.record(old, "a")
    cache.record(new, "a")
    assert cache.match(old, ["a"]) == {"a": 0}
    assert cache.match(new, ["a"]) == {"a": 4}
    assert cache.forget("a") == 4


def test_max_chunks_bounds_the_work_per_prompt() -> None:
    cache = ApproximatePrefixCache(chunk_chars=4, max_chunks=3)
    assert len(cache.keys("x" * 1000)) == 3


@given(st.text(max_size=300), st.text(max_size=300))
def test_common_chunks_are_common_keys(a: str, b: str) -> None:
    cache = ApproximatePrefixCache(chunk_chars=8)
    common = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    if common is None:
        common = min(len(a), len(b))
    shared = sum(1 for x, y in zip(cache.keys(a), cache.keys(b), strict=False) if x == y)
    assert shared == common // 8
