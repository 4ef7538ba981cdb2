"""``static`` and ``min-uncached-tokens``: tables and the admission property."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pd_orchestrator.model.route import threshold_of
from tests.policies.helpers import build, context


@pytest.mark.parametrize(
    ("spec", "value"),
    [
        ({"type": "static"}, 0.7),
        ({"type": "static", "params": {"value": 0.25}}, 0.25),
        ({"type": "static", "value": 0.9}, 0.9),
        ({"value": 0.0}, 0.0),
    ],
    ids=["default", "params", "legacy-shorthand", "type-defaults-to-static"],
)
def test_static_is_fixed(spec: dict[str, Any], value: float) -> None:
    policy = build(spec)
    for tokens in (0, 10, 100_000):
        decision = policy.decide(context(tokens=tokens))
        assert (threshold_of(decision), decision.policy, decision.reason) == (
            value,
            "static",
            "fixed",
        )
    assert policy.bounds == (value, value)


def test_static_instance_name_labels_its_decisions() -> None:
    policy = build({"type": "static", "name": "floor", "params": {"value": 0.5}})
    assert policy.decide(context()).policy == "floor"


def _min_uncached(n: int = 2048, ratio: float | None = None) -> Any:
    params: dict[str, Any] = {"max_uncached_tokens": n}
    if ratio is not None:
        params["max_uncached_ratio"] = ratio
    return build({"type": "min-uncached-tokens", "params": params})


@pytest.mark.parametrize(
    ("tokens", "n", "ratio", "value", "reason"),
    [
        (0, 2048, None, 0.0, "short-prompt"),
        (1000, 2048, None, 0.0, "short-prompt"),
        (2048, 2048, None, 0.5 / 2048, "uncached-tokens"),
        (4096, 2048, None, 1 - 2047.5 / 4096, "uncached-tokens"),
        (100_000, 2048, None, 1 - 2047.5 / 100_000, "uncached-tokens"),
        (1000, 2048, 0.7, 0.3, "uncached-ratio"),
        (2500, 2048, 0.7, 0.3, "uncached-ratio"),
        (10_000, 2048, 0.7, 1 - 2047.5 / 10_000, "uncached-tokens"),
        (10, 1, None, 0.95, "uncached-tokens"),
    ],
    ids=[
        "empty-prompt",
        "prompt-under-budget",
        "prompt-at-budget",
        "twice-the-budget",
        "long-prompt",
        "ratio-bound-short",
        "ratio-bound-binds",
        "token-budget-binds",
        "budget-of-one-token",
    ],
)
def test_min_uncached_tokens_table(
    tokens: int, n: int, ratio: float | None, value: float, reason: str
) -> None:
    decision = _min_uncached(n, ratio).decide(context(tokens=tokens))
    assert threshold_of(decision) == pytest.approx(value)
    assert (decision.policy, decision.reason) == ("min-uncached-tokens", reason)


def test_min_uncached_tokens_defaults_to_dynamos_budget() -> None:
    policy = build({"type": "min-uncached-tokens"})
    assert threshold_of(policy.decide(context(tokens=2047))) == 0.0
    assert threshold_of(policy.decide(context(tokens=2049))) > 0.0
    assert policy.bounds == (0.0, 1.0)
    assert _min_uncached(ratio=0.7).bounds == (pytest.approx(0.3), 1.0)


@given(
    prompt=st.integers(1, 1_000_000),
    budget=st.integers(1, 50_000),
    data=st.data(),
)
def test_admits_exactly_when_fewer_than_n_tokens_are_uncached(
    prompt: int, budget: int, data: st.DataObject
) -> None:
    hits = data.draw(st.integers(0, prompt))
    threshold = threshold_of(_min_uncached(budget).decide(context(tokens=prompt)))
    admitted = hits / prompt >= threshold  # the decoder's rule (RFC 24256)
    assert admitted == (prompt - hits < budget)
    assert 0.0 <= threshold <= 1.0


@given(
    prompt=st.integers(1, 1_000_000),
    budget=st.integers(1, 50_000),
    ratio=st.floats(0.0, 1.0),
    data=st.data(),
)
def test_the_ratio_bound_adds_a_second_condition(
    prompt: int, budget: int, ratio: float, data: st.DataObject
) -> None:
    hits = data.draw(st.integers(0, prompt))
    policy = _min_uncached(budget, ratio)
    threshold = threshold_of(policy.decide(context(tokens=prompt)))
    low, high = policy.bounds
    assert low <= threshold <= high
    admitted = hits / prompt >= threshold
    assert admitted == (prompt - hits < budget and hits / prompt >= 1 - ratio)
