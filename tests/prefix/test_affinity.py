"""The affinity prefix tree (Ray Serve's semantics) and its routing decision."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pd_orchestrator.prefix.affinity import (
    AffinityParams,
    PrefixTree,
    affinity_choice,
    power_of_two,
)


def tree_with(*routes: tuple[str, str]) -> PrefixTree:
    tree = PrefixTree()
    for now, (text, tenant) in enumerate(routes):
        tree.insert(text, tenant, float(now))
    return tree


@pytest.mark.parametrize(
    ("text", "tenants", "expected"),
    [
        ("hello world", {"a", "b"}, (11, ["a"])),
        ("hello there", {"a", "b"}, (6, ["a", "b"])),
        ("help", {"a", "b"}, (3, ["a", "b"])),
        ("hello world", {"b"}, (6, ["b"])),
        ("xyz", {"a", "b"}, (0, [])),
        ("hello world", {"c"}, (0, [])),
        ("", {"a"}, (0, [])),
    ],
    ids=["full", "split-edge", "inside-edge", "restricted", "no-match", "unknown", "empty"],
)
def test_prefix_match(text: str, tenants: set[str], expected: tuple[int, list[str]]) -> None:
    tree = tree_with(("hello world", "a"), ("hello moon", "b"))
    matched, holders = tree.prefix_match(text, tenants)
    assert (matched, sorted(holders)) == expected


def test_char_counts_and_smallest_tenants() -> None:
    tree = tree_with(("hello world", "a"), ("hello moon", "b"), ("hello world", "a"))
    assert tree.chars("a") == 11 and tree.chars("b") == 10
    assert tree.smallest_tenants(["a", "b"]) == ["b"]
    assert tree.smallest_tenants(["a", "b", "new"]) == ["new"]


def test_eviction_drops_least_recently_used_leaves_first() -> None:
    tree = tree_with(("shared-prefix/old-question", "a"), ("shared-prefix/new-question", "a"))
    assert tree.chars("a") == len("shared-prefix/old-question") + len("new-question")
    dropped = tree.evict("a", target_chars=len("shared-prefix/new-question"))
    assert dropped == len("old-question")
    assert tree.prefix_match("shared-prefix/old-question", {"a"})[0] == len("shared-prefix/")
    assert tree.prefix_match("shared-prefix/new-question", {"a"})[0] == 26


def test_remove_tenant_keeps_the_others() -> None:
    tree = tree_with(("hello world", "a"), ("hello moon", "b"))
    tree.remove_tenant("a")
    assert tree.chars("a") == 0 and "a" not in tree.tenants()
    assert tree.prefix_match("hello world", {"a", "b"}) == (6, ["b"])


def common_length(a: str, b: str) -> int:
    differing = (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    return next(differing, min(len(a), len(b)))


texts = st.lists(
    st.tuples(st.text(alphabet="ab", max_size=12), st.sampled_from(["x", "y"])), max_size=12
)


@given(routes=texts, probe=st.text(alphabet="ab", max_size=12))
def test_match_is_the_longest_common_prefix(routes: list[tuple[str, str]], probe: str) -> None:
    tree = tree_with(*routes)
    for tenant in ("x", "y"):
        seen = [text for text, t in routes if t == tenant]
        expected = max((common_length(probe, t) for t in seen), default=0)
        assert tree.prefix_match(probe, {tenant})[0] == expected
        assert tree.chars(tenant) <= sum(len(t) for t in seen)


@given(routes=texts, target=st.integers(0, 20))
def test_eviction_reaches_its_target_and_keeps_counts_exact(
    routes: list[tuple[str, str]], target: int
) -> None:
    tree = tree_with(*routes)
    tree.evict("x", target)
    assert tree.chars("x") <= target

    def count(node: object, tenant: str) -> int:
        total = len(node.text) if tenant in node.tenants else 0  # type: ignore[attr-defined]
        return total + sum(count(c, tenant) for c in node.children.values())  # type: ignore[attr-defined]

    for tenant in ("x", "y"):
        assert count(tree.root, tenant) == tree.chars(tenant)


def test_power_of_two_prefers_the_shorter_queue() -> None:
    depths = [5, 1, 9]
    picks = {power_of_two(depths, [0, 1, 2], "s", seq) for seq in range(50)}
    assert 2 not in picks  # the deepest queue never wins a pair
    assert power_of_two(depths, [2], "s", 0) == 2


PARAMS = AffinityParams(imbalanced_threshold=10, match_rate_threshold=0.1)


def test_a_good_match_routes_to_its_holder() -> None:
    tree = tree_with(("system prompt: be brief. question 1", "b"))
    names, depths = ["a", "b", "c"], [0, 3, 0]
    for seq in range(20):
        text = "system prompt: be brief. q2"
        chosen = affinity_choice(tree, text, names, depths, PARAMS, sequence=seq)
        assert names[chosen] == "b"


def test_a_poor_match_goes_to_the_least_used_caches() -> None:
    tree = tree_with(("zzzzzzzzzz" * 10, "a"), ("s" + "y" * 99, "b"))
    names = ["a", "b", "c"]
    chosen = affinity_choice(tree, "s" + "q" * 99, names, [0, 0, 0], PARAMS)
    assert names[chosen] == "c"  # 1% match on b is below the 10% threshold


def test_imbalance_falls_back_to_power_of_two() -> None:
    tree = tree_with(("shared prefix " * 10, "a"))
    names, depths = ["a", "b"], [12, 0]
    chosen = {
        affinity_choice(tree, "shared prefix " * 10, names, depths, PARAMS, sequence=s)
        for s in range(10)
    }
    assert chosen == {1}
