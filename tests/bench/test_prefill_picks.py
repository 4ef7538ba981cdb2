"""Dynamo's KV-aware prefill router, against its documented cost:
``max(0, active prefill blocks + request blocks - cached blocks)``, lowest wins."""

from __future__ import annotations

import pytest

from pd_orchestrator.bench.prefill_picks import (
    PrefillLoad,
    blocks_of,
    dynamo_pick,
    dynamo_prefill_cost,
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
