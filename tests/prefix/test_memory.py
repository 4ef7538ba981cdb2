"""The memory estimates of the prefix structures agree with what tracemalloc measures,
and stay bounded by their capacities."""

from __future__ import annotations

import random
import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from pd_orchestrator.prefix.affinity import PrefixTree
from pd_orchestrator.prefix.approximate import ApproximatePrefixCache
from pd_orchestrator.prefix.table import BlockTable


@contextmanager
def traced() -> Iterator[Callable[[], int]]:
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        yield lambda: tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()


def assert_close(estimate: int, measured: int, tolerance: float = 0.25) -> None:
    assert abs(estimate - measured) <= tolerance * measured, (estimate, measured)


def test_block_table_estimate() -> None:
    """Keys arrive as fresh int objects per event, as decoded KV events bring them."""
    rng = random.Random(1)
    with traced() as measured:
        table = BlockTable(capacity=50_000)
        for i in range(3):
            chunk = [rng.getrandbits(64) for _ in range(20_000)]
            table.add(f"e{i}", chunk)
            table.add(f"e{(i + 1) % 3}", [int(str(k)) for k in chunk[:5000]])
            del chunk
        assert_close(table.memory_bytes(), measured())


def test_approximate_cache_estimate_and_bound() -> None:
    rng = random.Random(2)
    texts = ["".join(rng.choice("abcdefgh ") for _ in range(4000)) for _ in range(30)]
    with traced() as measured:
        cache = ApproximatePrefixCache(capacity_per_endpoint=2000)
        for i in range(300):
            cache.record(cache.keys(f"{i} {texts[i % 30]}"), f"e{i % 4}")
        assert_close(cache.memory_bytes(), measured())
    assert all(cache.table.size(f"e{i}") == 2000 for i in range(4))


def test_affinity_tree_estimate_and_bound() -> None:
    rng = random.Random(3)
    texts = ["".join(rng.choice("abcdefgh ") for _ in range(3000)) for _ in range(20)]
    with traced() as measured:
        tree = PrefixTree()
        for i in range(300):
            tree.insert(texts[i % 20][: 1000 + (i * 37) % 2000] + f"{i}" * 40, f"e{i % 4}", i)
            if tree.chars(f"e{i % 4}") > 20_000:
                tree.evict(f"e{i % 4}", 15_000)
        assert_close(tree.memory_bytes(), measured())
    assert all(tree.chars(f"e{i}") <= 20_000 for i in range(4))
