"""The block table: prefix lengths, LRU capacity, removal and a model check."""

from __future__ import annotations

from collections import OrderedDict

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pd_orchestrator.prefix.table import BlockTable


def table_with(**held: list[int]) -> BlockTable:
    table = BlockTable()
    for name, keys in held.items():
        table.add(name, keys)
    return table


@pytest.mark.parametrize(
    ("keys", "expected"),
    [
        ([1, 2, 3, 4], {"a": 4, "b": 2, "c": 0}),
        ([1, 2, 9], {"a": 2, "b": 2, "c": 0}),
        ([9, 1, 2], {"a": 0, "b": 0, "c": 0}),
        ([7], {"a": 0, "b": 0, "c": 1}),
        ([], {"a": 0, "b": 0, "c": 0}),
    ],
    ids=["full", "diverges", "first-miss", "other-chain", "empty"],
)
def test_prefix_lengths(keys: list[int], expected: dict[str, int]) -> None:
    table = table_with(a=[1, 2, 3, 4], b=[1, 2, 4], c=[7, 8])
    assert table.prefix_lengths(keys, ["a", "b", "c"]) == expected


def test_unknown_endpoints_match_nothing() -> None:
    assert table_with(a=[1]).prefix_lengths([1], ["a", "zz"]) == {"a": 1, "zz": 0}


def test_capacity_evicts_the_least_recently_added() -> None:
    """The nanoGPT LRU case: three slots, four blocks, the first is evicted."""
    table = BlockTable(capacity=3)
    for key in (10, 11, 12):
        table.add("a", [key])
    table.add("a", [10])  # refreshed: 11 is now the oldest
    assert table.add("a", [13]) == 1
    assert not table.holds("a", 11)
    assert all(table.holds("a", k) for k in (10, 12, 13))
    assert table.evictions == 1


def test_remove_and_clear() -> None:
    table = table_with(a=[1, 2], b=[1])
    assert table.remove("a", [1, 5]) == 1
    assert table.holders(1) == {"b"}
    assert table.clear("b") == 1
    assert table.holders(1) == frozenset()
    assert len(table) == 1 and table.endpoints() == ["a"]
    assert table.clear("b") == 0 and table.remove("zz", [1]) == 0


def test_ids_are_reused_after_a_clear() -> None:
    table = BlockTable()
    for round_ in range(100):
        table.add(f"e{round_}", [round_])
        table.clear(f"e{round_}")
    table.add("last", [1])
    assert table.holders(1) == {"last"}
    assert table.prefix_lengths([1], ["last"]) == {"last": 1}


def test_memory_is_bounded_by_capacity() -> None:
    table = BlockTable(capacity=1000)
    table.add("a", range(1000))
    full = table.memory_bytes()
    table.add("a", range(1000, 50_000))
    assert table.size("a") == 1000
    assert table.memory_bytes() < 2 * full


ops = st.lists(
    st.tuples(
        st.sampled_from(["add", "remove", "clear"]),
        st.sampled_from(["a", "b", "c"]),
        st.lists(st.integers(0, 12), max_size=6),
    ),
    max_size=40,
)


@given(ops=ops, query=st.lists(st.integers(0, 12), max_size=8))
def test_matches_a_naive_model(ops: list[tuple[str, str, list[int]]], query: list[int]) -> None:
    table = BlockTable(capacity=5)
    model: dict[str, OrderedDict[int, None]] = {}
    for op, name, keys in ops:
        held = model.setdefault(name, OrderedDict())
        if op == "add":
            table.add(name, keys)
            for key in keys:
                held.pop(key, None)
                held[key] = None
            while len(held) > 5:
                held.popitem(last=False)
        elif op == "remove":
            table.remove(name, keys)
            for key in keys:
                held.pop(key, None)
        else:
            table.clear(name)
            held.clear()
    for name, held in model.items():
        assert table.size(name) == len(held)
        expected = next((i for i, k in enumerate(query) if k not in held), len(query))
        assert table.prefix_lengths(query, [name])[name] == expected
    assert len(table) == len(set().union(*model.values())) if model else len(table) == 0
