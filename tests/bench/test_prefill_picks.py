"""The peers' prefill picks against their documented rules: Dynamo's KV-aware cost
``max(0, active prefill blocks + request blocks - cached blocks)``, lowest wins;
llm-d's prefix (2) and queue (1) scorers; vllm-router's ``cache_aware``."""

from __future__ import annotations

import pytest

from pd_orchestrator.bench.prefill_picks import (
    PrefillLoad,
    blocks_of,
    cache_aware_pick,
    dynamo_pick,
    dynamo_prefill_cost,
    llm_d_pick,
)

BLOCK = 16

COST_CASES = [
    # (active tokens, cached tokens, prompt tokens, cost in blocks)
    (0, 0, 160, 10),  # idle, cold: the prompt's blocks
    (0, 160, 160, 0),  # idle, all cached: no cost
    (32, 0, 160, 12),  # 2 queued blocks + 10
    (0, 150, 160, 1),  # 9 whole cached blocks credit; a partial block does not
    (0, 0, 161, 11),  # a partial block is charged
    (0, 10_000, 160, 0),  # credit beyond the load: floored at 0
]


@pytest.mark.parametrize(("active", "cached", "prompt", "cost"), COST_CASES)
def test_dynamo_prefill_cost_is_queued_plus_prompt_blocks_less_the_cached(
    active: int, cached: int, prompt: int, cost: int
) -> None:
    assert dynamo_prefill_cost(PrefillLoad("p", active, cached), prompt, BLOCK) == cost


PICK_CASES = [
    # (loads as (name, active, cached), prompt tokens, pick)
    ((("a", 0, 0), ("b", 0, 0)), 1600, "a"),  # equal cost: the first in order
    ((("a", 1600, 0), ("b", 0, 0)), 1600, "b"),  # the idle one
    ((("a", 800, 1600), ("b", 0, 0)), 1600, "a"),  # 50 + 100 - 100 < 100: the cache wins
    ((("a", 3200, 1600), ("b", 0, 0)), 1600, "b"),  # 200 + 100 - 100 > 100: the load wins
    # The case: a 5,954-token prompt and an 87,169-token one ahead on "a".
    ((("a", 87_169, 0), ("b", 0, 0)), 5954, "b"),
]


@pytest.mark.parametrize(("loads", "prompt", "pick"), PICK_CASES)
def test_dynamo_picks_the_lowest_cost_prefiller(
    loads: tuple[tuple[str, int, int], ...], prompt: int, pick: str
) -> None:
    assert dynamo_pick([PrefillLoad(*load) for load in loads], prompt, BLOCK) == pick


def test_dynamo_pick_needs_a_worker_and_blocks_round_up() -> None:
    with pytest.raises(ValueError, match="no prefill worker"):
        dynamo_pick([], 100, BLOCK)
    assert (blocks_of(0, BLOCK), blocks_of(1, BLOCK), blocks_of(16, BLOCK)) == (0, 1, 1)


def _loads(*rows: tuple[str, int, int, int, int, int]) -> list[PrefillLoad]:
    return [PrefillLoad(*row) for row in rows]


LLM_D_CASES = [
    # (name, active, cached, waiting, in flight, routed) per worker; prompt; pick
    ((("a", 0, 0, 0, 0, 0), ("b", 0, 0, 0, 0, 0)), 1600, "a"),  # all equal: the first
    ((("a", 0, 0, 5, 0, 0), ("b", 0, 0, 0, 0, 0)), 1600, "b"),  # queue 1 vs 0
    # a: prefix 1.0 x 2 + queue 0 = 2; b: prefix 0 + queue 1 = 1: the cache wins
    ((("a", 0, 1600, 5, 0, 0), ("b", 0, 0, 0, 0, 0)), 1600, "a"),
    # a: prefix 0.4 x 2 + 0 = 0.8; b: 0 + 1 = 1: the queue wins
    ((("a", 0, 640, 5, 0, 0), ("b", 0, 0, 0, 0, 0)), 1600, "b"),
]


@pytest.mark.parametrize(("loads", "prompt", "pick"), LLM_D_CASES)
def test_llm_d_scores_prefix_twice_and_queue_once(
    loads: tuple[tuple[str, int, int, int, int, int], ...], prompt: int, pick: str
) -> None:
    assert llm_d_pick(_loads(*loads), prompt, BLOCK) == pick


CACHE_AWARE_CASES = [
    # imbalanced (100 - 10 > 64 and 100 > 15): the least in flight, whatever the cache
    ((("a", 0, 1600, 0, 100, 0), ("b", 0, 0, 0, 10, 0)), 1600, "b"),
    # 70 - 10 = 60, not > 64: balanced, the best match (1.0 > 0.3)
    ((("a", 0, 1600, 0, 70, 0), ("b", 0, 0, 0, 10, 0)), 1600, "a"),
    # match 0.3 is not > 0.3: the smallest tree (fewest tokens routed)
    ((("a", 0, 480, 0, 0, 9000), ("b", 0, 0, 0, 0, 100)), 1600, "b"),
    ((("a", 0, 496, 0, 0, 9000), ("b", 0, 0, 0, 0, 100)), 1600, "a"),  # 0.31
]


@pytest.mark.parametrize(("loads", "prompt", "pick"), CACHE_AWARE_CASES)
def test_vllm_router_cache_aware_balances_then_matches_then_fills_the_smallest_tree(
    loads: tuple[tuple[str, int, int, int, int, int], ...], prompt: int, pick: str
) -> None:
    assert cache_aware_pick(_loads(*loads), prompt) == pick
