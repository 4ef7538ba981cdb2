"""The prefix scorers as pipeline plugins: tables, learning through observe, config."""

from __future__ import annotations

from typing import Any

import pytest

from pd_orchestrator.policies.plugins import builtin_registry
from pd_orchestrator.prefix.codec import BlockStored, EventBatch
from pd_orchestrator.prefix.hashing import VllmBlockHasher
from pd_orchestrator.prefix.index import PreciseIndex
from pd_orchestrator.routing import RoutingConfig, RoutingConfigError, build_profiles
from pd_orchestrator.routing.prefix_scorers import (
    AffinityScorerParams,
    ApproximatePrefixParams,
    ApproximatePrefixScorer,
    PrecisePrefixParams,
    PrecisePrefixScorer,
    PrefixAffinityScorer,
)
from tests.routing.helpers import candidate, endpoint, load, request

TOKENS = tuple(range(1000, 1064))  # four blocks of 16
SYSTEM = "You answer questions about invoices; be precise and polite. " * 10


def precise_index() -> PreciseIndex:
    index = PreciseIndex(VllmBlockHasher(16), lora_paths={"sql": "/adapters/sql"})
    digests = index.hasher.block_hashes(TOKENS)
    index.apply("a", EventBatch(0.0, (BlockStored(tuple(digests), None, TOKENS, 16),)))
    index.apply("b", EventBatch(0.0, (BlockStored(tuple(digests[:1]), None, TOKENS[:16], 16),)))
    return index


@pytest.mark.parametrize(
    ("fields", "floor", "expected"),
    [
        ({"token_ids": TOKENS}, 0.0, [1.0, 0.25, 0.0]),
        ({"token_ids": TOKENS + (7,) * 10}, 0.0, [1.0, 0.25, 0.0]),
        ({"token_ids": TOKENS[:16] + (9,) * 48}, 0.0, [0.25, 0.25, 0.0]),
        ({"token_ids": TOKENS[:16] + (9,) * 48}, 0.5, [0.0, 0.0, 0.0]),
        ({"token_ids": None}, 0.0, [0.0, 0.0, 0.0]),
        ({"token_ids": TOKENS, "lora": "sql"}, 0.0, [0.0, 0.0, 0.0]),
        ({"token_ids": TOKENS, "lora": "unknown"}, 0.0, [0.0, 0.0, 0.0]),
        ({"token_ids": TOKENS, "cache_salt": "t"}, 0.0, [0.0, 0.0, 0.0]),
    ],
    ids=[
        "full-prompt",
        "partial-tail-ignored",
        "diverging",
        "below-min-ratio",
        "no-token-ids",
        "other-adapter",
        "adapter-without-path",
        "salted",
    ],
)
def test_precise_prefix(fields: dict[str, Any], floor: float, expected: list[float]) -> None:
    scorer = PrecisePrefixScorer(precise_index(), PrecisePrefixParams(min_match_ratio=floor))
    candidates = [candidate("a"), candidate("b"), candidate("c")]
    assert list(scorer.score(request(**fields), candidates)) == pytest.approx(expected)


def test_approximate_prefix_learns_from_observed_decisions() -> None:
    scorer = ApproximatePrefixScorer(ApproximatePrefixParams())
    candidates = [candidate("a"), candidate("b")]
    first = request(prompt=SYSTEM + "Where is invoice 12?", model="m")
    assert scorer.score(first, candidates) == [0.0, 0.0]
    scorer.observe(first, endpoint("b"))
    follow_up = request(prompt=SYSTEM + "And invoice 13? " * 13, model="m")  # 12 chunks
    assert scorer.score(follow_up, candidates) == [0.0, pytest.approx(9 / 12)]
    other_adapter = request(prompt=SYSTEM + "And invoice 13?", model="m", lora="sql")
    assert scorer.score(other_adapter, candidates) == [0.0, 0.0]


@pytest.mark.parametrize(
    ("b", "expected_b"),
    [
        (candidate("b", in_flight=8), True),
        (candidate("b", in_flight=9), False),
        (candidate("b", reading=load(kv=0.97)), False),
    ],
    ids=["within-slack", "too-deep", "cache-full"],
)
def test_approximate_prefix_avoids_hot_spots(b: Any, expected_b: bool) -> None:
    scorer = ApproximatePrefixScorer(ApproximatePrefixParams())
    scorer.observe(request(prompt=SYSTEM), endpoint("b"))
    scores = scorer.score(request(prompt=SYSTEM + "?"), [candidate("a"), b])
    assert (scores[1] > 0) is expected_b


def test_prefix_affinity_routes_to_the_holder_and_learns() -> None:
    scorer = PrefixAffinityScorer(AffinityScorerParams(), "salt")
    candidates = [candidate("a"), candidate("b"), candidate("c")]
    scorer.observe(request(prompt=SYSTEM + "first"), endpoint("c"))
    for sequence in range(10):
        scores = scorer.score(request(prompt=SYSTEM + "next", sequence=sequence), candidates)
        assert scores == [0.0, 0.0, 1.0]


def test_prefix_affinity_prefers_balance_when_queues_spread() -> None:
    scorer = PrefixAffinityScorer(AffinityScorerParams(imbalanced_threshold=2), "salt")
    scorer.observe(request(prompt=SYSTEM), endpoint("a"))
    candidates = [candidate("a", in_flight=5), candidate("b")]
    assert scorer.score(request(prompt=SYSTEM), candidates) == [0.0, 1.0]


def test_prefix_affinity_tree_stays_under_its_eviction_threshold() -> None:
    params = AffinityScorerParams(eviction_threshold_chars=2000, eviction_target_chars=1500)
    scorer = PrefixAffinityScorer(params, "salt")
    for n in range(50):
        scorer.observe(request(prompt=f"{n:04d}" + "x" * 200), endpoint("a"))
        assert scorer.tree.chars("a") <= 2000
    assert scorer.memory_bytes() > 0


PREFIX_ROUTING = {
    "decode": {
        "scorers": [
            {"type": "precise-prefix", "weight": 3},
            {"type": "kv-usage", "weight": 2},
            {"type": "approximate-prefix", "params": {"chunk_chars": 32}},
            {"type": "prefix-affinity", "weight": 0.5, "params": {"imbalanced_threshold": 4}},
        ]
    }
}


def test_profiles_with_prefix_scorers_build_from_config_and_observe() -> None:
    profiles = build_profiles(
        RoutingConfig.model_validate(PREFIX_ROUTING), builtin_registry(precise_index())
    )
    decode = profiles.decode
    candidates = [candidate("a"), candidate("b")]
    routed = request(prompt=SYSTEM, token_ids=TOKENS)
    assert decode.run(routed, candidates).endpoints[0].name == "a"
    decode.observe(routed, endpoint("b"))
    plugins = {type(p).__name__: p for p in decode.plugins()}
    approximate = plugins["ApproximatePrefixScorer"]
    affinity = plugins["PrefixAffinityScorer"]
    assert isinstance(approximate, ApproximatePrefixScorer)
    assert isinstance(affinity, PrefixAffinityScorer)
    assert approximate.cache.table.size("b") == len(SYSTEM) // 32
    assert affinity.tree.chars("b") > len(SYSTEM)


@pytest.mark.parametrize(
    ("scorer", "fragment"),
    [
        ({"type": "precise-prefix"}, "needs the precise prefix index"),
        ({"type": "approximate-prefix", "params": {"chunk_size": 8}}, "unknown field"),
        (
            {"type": "prefix-affinity", "params": {"eviction_target_chars": 10**7}},
            "must not exceed",
        ),
    ],
    ids=["precise-without-index", "unknown-param", "target-above-threshold"],
)
def test_prefix_scorer_config_errors(scorer: dict[str, Any], fragment: str) -> None:
    config = RoutingConfig.model_validate({"decode": {"scorers": [scorer]}})
    with pytest.raises(RoutingConfigError, match=fragment):
        build_profiles(config, builtin_registry())
