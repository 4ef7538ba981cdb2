"""The peers' rules (Dynamo's conditional disaggregation, llm-d's prefix decider),
against the cases their sources and tests state."""

from __future__ import annotations

import pytest

from pd_orchestrator.model.route import threshold_of
from pd_orchestrator.policies.peers import DynamoPolicy, LlmdPolicy, prefill_queue
from tests.policies.helpers import build, context, load, prefiller


def _admits(threshold: float, tokens: int, uncached: int) -> bool:
    """The decoder's own test: admit iff the hit ratio reaches the threshold."""
    return (tokens - uncached) / tokens >= threshold


def test_dynamo_keeps_a_short_uncached_part_local_and_sends_a_long_one_remote() -> None:
    """Dynamo's router test: 1000-token prefill with 500 cached is local; 8192 with 100
    cached is remote while the queue is short, local once it is deep."""
    policy = DynamoPolicy(max_local_prefill_length=4096, max_prefill_queue_size=8)
    short = policy.decide(context(tokens=1000))
    assert threshold_of(short) == 0.0 and short.reason == "short-prompt"
    long = policy.decide(context(tokens=8192))
    assert not _admits(threshold_of(long), 8192, 8192 - 100)  # 8092 uncached: remote
    assert _admits(threshold_of(long), 8192, 4096) and not _admits(threshold_of(long), 8192, 4097)
    deep = (prefiller("p0", reading=load(running=6, waiting=5)),)
    full = policy.decide(context(tokens=8192, prefillers=deep))
    assert threshold_of(full) == 0.0 and full.reason == "prefill-queue-full"


def test_dynamo_defaults_are_dynamo_s() -> None:
    policy = build({"type": "dynamo"})
    assert isinstance(policy, DynamoPolicy)
    assert (policy.max_local_prefill_length, policy.max_prefill_queue_size) == (1000, 2)
    decision = policy.decide(context(tokens=3000))
    assert _admits(threshold_of(decision), 3000, 1000) and not _admits(
        threshold_of(decision), 3000, 1001
    )


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
        {"type": "dynamo", "params": {"max_prefill_queue_size": -1}},
        {"type": "llm-d", "params": {"non_cached_tokens": -5}},
    ],
)
def test_negative_limits_are_refused(spec: dict[str, object]) -> None:
    with pytest.raises(Exception, match="greater than or equal to 0"):
        build(spec)
