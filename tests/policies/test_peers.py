"""The peers' rules (Dynamo's conditional disaggregation, llm-d's prefix decider),
against the cases their sources and tests state."""

from __future__ import annotations

import pytest

from pd_orchestrator.model.route import GoPD, Local, threshold_of
from pd_orchestrator.policies.peers import (
    DynamoLegacyPolicy,
    DynamoPolicy,
    LlmdPolicy,
    isl_bound,
    prefill_queue,
)
from tests.policies.helpers import build, context, load, prefiller


def _admits(threshold: float, tokens: int, uncached: int) -> bool:
    """The decoder's own test: admit iff the hit ratio reaches the threshold."""
    return (tokens - uncached) / tokens >= threshold


def test_dynamo_legacy_keeps_a_short_uncached_part_local_and_sends_a_long_one_remote() -> None:
    """Dynamo 0.1-0.3's router test: 1000-token prefill with 500 cached is local; 8192 with 100
    cached is remote while the queue is short, local once it is deep."""
    policy = DynamoLegacyPolicy(max_local_prefill_length=4096, max_prefill_queue_size=8)
    short = policy.decide(context(tokens=1000))
    assert threshold_of(short) == 0.0 and short.reason == "short-prompt"
    long = policy.decide(context(tokens=8192))
    assert not _admits(threshold_of(long), 8192, 8192 - 100)  # 8092 uncached: remote
    assert _admits(threshold_of(long), 8192, 4096) and not _admits(threshold_of(long), 8192, 4097)
    deep = (prefiller("p0", reading=load(running=6, waiting=5)),)
    full = policy.decide(context(tokens=8192, prefillers=deep))
    assert threshold_of(full) == 0.0 and full.reason == "prefill-queue-full"


def test_dynamo_legacy_defaults_are_dynamo_0_1_s() -> None:
    policy = build({"type": "dynamo-legacy"})
    assert isinstance(policy, DynamoLegacyPolicy)
    assert (policy.max_local_prefill_length, policy.max_prefill_queue_size) == (1000, 2)
    decision = policy.decide(context(tokens=3000))
    assert _admits(threshold_of(decision), 3000, 1000) and not _admits(
        threshold_of(decision), 3000, 1001
    )


def _dynamo_local(policy: DynamoPolicy, tokens: int, uncached: int, busy: int = 0) -> bool:
    """Whether the decoder keeps a ``tokens`` prompt with ``uncached`` tokens uncached
    under ``policy`` (one prefiller with ``busy`` prompt tokens outstanding)."""
    decision = policy.decide(context(tokens=tokens, prefillers=(prefiller(backlog=busy),)))
    if isinstance(decision, GoPD):  # P/D at once: no decoder is asked
        return False
    return _admits(threshold_of(decision), tokens, uncached)


# Dynamo's isl_bounding (conditional_disagg.rs): local iff eff_isl < 2048 and
# eff_isl / isl < 0.7, both strict.
ISL_BOUNDING_CASES = [
    # (prompt tokens, uncached, local)
    (10_000, 2047, True),  # just under the ISL bound, ratio 0.2047
    (10_000, 2048, False),  # at the ISL bound: strict
    (10_000, 10_000, False),  # cold
    (2000, 1399, True),  # ratio 0.6995
    (2000, 1400, False),  # ratio exactly 0.7: strict
    (2000, 2000, False),  # a cold short prompt goes remote (ratio 1)
    (100, 69, True),
    (100, 70, False),
    (100, 0, True),  # fully cached
    (2925, 2047, True),  # both bounds near: 2047 / 2925 = 0.69983
    (2925, 2048, False),
]


@pytest.mark.parametrize(("tokens", "uncached", "local"), ISL_BOUNDING_CASES)
def test_dynamo_isl_bounding_keeps_local_exactly_what_dynamo_keeps(
    tokens: int, uncached: int, local: bool
) -> None:
    policy = build({"type": "dynamo"})
    assert isinstance(policy, DynamoPolicy) and policy.rule == "isl_bounding"
    assert (policy.eff_isl_threshold, policy.eff_isl_ratio_threshold) == (2048, 0.7)
    assert _dynamo_local(policy, tokens, uncached) is local
    assert (uncached < 2048 and uncached / tokens < 0.7) is local  # the documented rule
    # A busy prefiller changes nothing under isl_bounding.
    assert _dynamo_local(policy, tokens, uncached, busy=10**6) is local


@pytest.mark.parametrize(
    ("tokens", "ratio", "expected"),
    [(2000, 0.7, 1400), (100, 0.7, 70), (10_000, 0.7, 2048), (1, 0.7, 1), (0, 0.7, 1)],
)
def test_the_isl_bound_is_the_first_uncached_count_that_goes_remote(
    tokens: int, ratio: float, expected: int
) -> None:
    assert isl_bound(tokens, 2048, ratio) == expected


def test_a_zero_ratio_bound_sends_every_prompt_remote() -> None:
    policy = build({"type": "dynamo", "params": {"eff_isl_ratio_threshold": 0.0}})
    route = policy.decide(context(tokens=5000))
    assert isinstance(route, GoPD) and route.reason == "remote"


# prefill_load: local iff the picked prefiller's outstanding prompt tokens exceed
# prefill_busy_threshold x max_num_batched_tokens (4 x 8192 = 32768), strict.
LOAD_CASES = [
    # (rule, tokens, uncached, prefill backlog, local)
    ("prefill_load", 10_000, 10_000, 32_768, False),  # at the bound: calm
    ("prefill_load", 10_000, 10_000, 32_769, True),  # busy
    ("prefill_load", 10_000, 0, 0, False),  # calm: always remote, even fully cached
    ("isl_or_load", 10_000, 10_000, 32_769, True),  # busy
    ("isl_or_load", 10_000, 10_000, 32_768, False),  # calm, cold
    ("isl_or_load", 10_000, 2047, 0, True),  # calm, ISL bound holds
    ("isl_or_load", 10_000, 2048, 0, False),
]


@pytest.mark.parametrize(("rule", "tokens", "uncached", "busy", "local"), LOAD_CASES)
def test_dynamo_load_rules_keep_local_when_the_picked_prefiller_is_busy(
    rule: str, tokens: int, uncached: int, busy: int, local: bool
) -> None:
    policy = build({"type": "dynamo", "params": {"policy": rule}})
    assert isinstance(policy, DynamoPolicy)
    assert _dynamo_local(policy, tokens, uncached, busy) is local


def test_dynamo_picks_the_least_backlogged_prefiller_and_counts_none_as_calm() -> None:
    policy = build({"type": "dynamo", "params": {"policy": "prefill_load"}})
    assert isinstance(policy, DynamoPolicy)
    one_calm = (prefiller("a", backlog=10**6), prefiller("b", backlog=100))
    assert isinstance(policy.decide(context(tokens=5000, prefillers=one_calm)), GoPD)
    all_busy = (prefiller("a", backlog=10**6), prefiller("b", backlog=40_000))
    busy = policy.decide(context(tokens=5000, prefillers=all_busy))
    assert isinstance(busy, Local) and busy.reason == "prefill-busy"
    assert isinstance(policy.decide(context(tokens=5000, prefillers=())), GoPD)


def test_the_prefill_queue_counts_what_waits_beyond_one_request_per_prefiller() -> None:
    assert prefill_queue(()) == 0
    assert prefill_queue((prefiller("a", in_flight=1), prefiller("b", in_flight=1))) == 0
    assert prefill_queue((prefiller("a", in_flight=3),)) == 2  # the gateway's own count
    stale_low = prefiller("a", in_flight=1, reading=load(running=2, waiting=2))
    assert prefill_queue((stale_low,)) == 3  # other gateways' requests, from the reading


def test_llm_d_disaggregates_from_non_cached_tokens_and_never_by_default() -> None:
    """llm-d's decider: 0 (its default) disables P/D; otherwise the decode profile
    alone when fewer than ``nonCachedTokens`` are uncached."""
    off = build({"type": "llm-d"})
    assert off.decide(context(tokens=50_000)).reason == "disabled"
    policy = LlmdPolicy(non_cached_tokens=16)
    assert threshold_of(policy.decide(context(tokens=10))) == 0.0
    decision = policy.decide(context(tokens=1000))
    assert _admits(threshold_of(decision), 1000, 15) and not _admits(
        threshold_of(decision), 1000, 16
    )


@pytest.mark.parametrize(
    "spec",
    [
        {"type": "dynamo-legacy", "params": {"max_prefill_queue_size": -1}},
        {"type": "dynamo", "params": {"eff_isl_threshold": -1}},
        {"type": "llm-d", "params": {"non_cached_tokens": -5}},
    ],
)
def test_negative_limits_are_refused(spec: dict[str, object]) -> None:
    with pytest.raises(Exception, match="greater than or equal to 0"):
        build(spec)
