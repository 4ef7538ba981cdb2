"""``slo-feedback``: the direction of each move, its size, the window, the bounds."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from pd_orchestrator.model.route import Route, threshold_of
from pd_orchestrator.policies import (
    LatencyObservation,
    SloFeedbackParams,
    SloFeedbackPolicy,
)
from pd_orchestrator.policies.slo_feedback import percentile
from tests.policies.helpers import context

TARGETS = {"ttft_p90": 1.0, "itl_p99": 0.05}


def _policy(**params: Any) -> SloFeedbackPolicy:
    merged = {**TARGETS, "min_samples": 5, **params}
    return SloFeedbackPolicy(SloFeedbackParams.model_validate(merged))


def _feed(
    policy: SloFeedbackPolicy,
    at: float,
    ttft: float | None,
    itl: float | None,
    count: int = 10,
) -> None:
    for _ in range(count):
        policy.observe(LatencyObservation("m", "decode", at, ttft=ttft, itl=itl))


def _step(policy: SloFeedbackPolicy, at: float, ttft: float | None, itl: float | None) -> Route:
    """Feed samples at ``at``, then decide one interval later (one control step)."""
    _feed(policy, at, ttft, itl)
    return policy.decide(context(now=at + policy.params.interval))


def _started(**params: Any) -> SloFeedbackPolicy:
    policy = _policy(**params)
    policy.decide(context(now=0.0))  # the controller's clock starts
    return policy


def test_it_starts_at_base_warming_up() -> None:
    decision = _policy().decide(context(now=0.0))
    assert (threshold_of(decision), decision.policy, decision.reason) == (
        0.7,
        "slo-feedback",
        "warming-up",
    )


@pytest.mark.parametrize(
    ("ttft", "itl", "value", "reason"),
    [
        (0.5, 0.075, 0.7 + 0.05 * 0.5, "itl-over-target"),
        (0.5, 0.5, 0.75, "itl-over-target"),
        (1.5, 0.04, 0.7 - 0.05 * 0.5, "ttft-over-target"),
        (5.0, 0.04, 0.65, "ttft-over-target"),
        (3.0, 0.1, 0.75, "itl-over-target"),
        (1.05, 0.052, 0.7, "within-targets"),
        (0.1, 0.01, 0.7, "within-targets"),
        (1.5, None, 0.675, "ttft-over-target"),
    ],
    ids=[
        "itl-over-by-half",
        "itl-over-capped-at-gain",
        "ttft-over-by-half",
        "ttft-over-capped",
        "both-over-itl-first",
        "within-tolerance",
        "headroom-at-base",
        "itl-unmeasured",
    ],
)
def test_one_step_table(ttft: float, itl: float | None, value: float, reason: str) -> None:
    decision = _step(_started(), 0.0, ttft, itl)
    assert threshold_of(decision) == pytest.approx(value)
    assert decision.reason == reason


def test_with_headroom_it_relaxes_towards_base() -> None:
    policy = _started()
    for k in range(3):  # raised to 0.85
        _step(policy, 5.0 * k, 0.5, 0.5)
    assert policy.threshold == pytest.approx(0.85)
    relaxed = [_step(policy, 15.0 + 5.0 * k, 0.1, 0.01) for k in range(8)]
    assert [threshold_of(d) for d in relaxed[:6]] == pytest.approx(
        [0.825, 0.8, 0.775, 0.75, 0.725, 0.7]
    )
    assert relaxed[0].reason == "relaxing"
    assert (
        threshold_of(relaxed[-1]) == pytest.approx(0.7) and relaxed[-1].reason == "within-targets"
    )


def test_a_move_restarts_the_window() -> None:
    policy = _started()
    raised = _step(policy, 0.0, 0.5, 0.5)
    assert threshold_of(raised) == pytest.approx(0.75)
    # No sample since the move: the next steps hold, whatever came before.
    held = policy.decide(context(now=10.0))
    assert (threshold_of(held), held.reason) == (threshold_of(raised), "itl-over-target")


def test_too_few_samples_hold() -> None:
    policy = _started(min_samples=50)
    decision = _step(policy, 0.0, 10.0, 10.0)
    assert (threshold_of(decision), decision.reason) == (0.7, "warming-up")


def test_samples_older_than_the_window_are_forgotten() -> None:
    policy = _started(window=10.0)
    _feed(policy, 0.0, 10.0, 10.0)
    decision = policy.decide(context(now=30.0))
    assert threshold_of(decision) == 0.7


def test_steps_are_at_least_an_interval_apart() -> None:
    policy = _started()
    first = _step(policy, 0.0, 0.5, 0.5)
    _feed(policy, 5.0, 0.5, 0.5)
    again = policy.decide(context(now=9.0))  # 4 s after the last step
    assert threshold_of(again) == threshold_of(first)
    assert threshold_of(policy.decide(context(now=10.0))) > threshold_of(first)


def test_sustained_violations_stop_at_the_bounds() -> None:
    up, down = _started(), _started()
    for k in range(40):
        _step(up, 5.0 * k, 0.1, 1.0)
        _step(down, 5.0 * k, 10.0, 0.01)
    assert threshold_of(up.decide(context(now=1000.0))) == 0.95
    assert threshold_of(down.decide(context(now=1000.0))) == 0.0
    assert up.bounds == (0.0, 0.95)


@pytest.mark.parametrize(
    ("params", "fragment"),
    [
        ({"ttft_p90": None, "itl_p99": None}, "at least one target"),
        ({"window": 1.0, "interval": 5.0}, "window"),
        ({"floor": 0.9}, "floor <= base <= ceiling"),
        ({"ttft_p90": 0.0}, "ttft_p90"),
        ({"min_samples": 10, "max_samples": 5}, "min_samples"),
    ],
    ids=["no-target", "window-under-interval", "floor-above-base", "zero-target", "samples"],
)
def test_inconsistent_params_are_refused(params: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ValidationError, match=fragment):
        SloFeedbackParams.model_validate({**TARGETS, **params})


def test_percentile_is_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 0.9) == 90.0
    assert percentile(values, 0.99) == 99.0
    assert percentile([3.0], 0.99) == 3.0


latency = st.floats(0.001, 20.0)


@settings(max_examples=60)
@given(
    steps=st.lists(st.tuples(latency, latency), min_size=1, max_size=30),
    gain=st.floats(0.01, 0.5),
)
def test_values_stay_within_bounds(steps: list[tuple[float, float]], gain: float) -> None:
    policy = _started(gain=gain, floor=0.2, base=0.5, ceiling=0.9)
    for k, (ttft, itl) in enumerate(steps):
        value = threshold_of(_step(policy, 5.0 * k, ttft, itl))
        assert 0.2 <= value <= 0.9


@settings(max_examples=60)
@given(itls=st.lists(st.floats(0.056, 5.0), min_size=1, max_size=20), ttft=latency)
def test_itl_over_target_raises_until_the_ceiling(itls: list[float], ttft: float) -> None:
    policy = _started()
    before = policy.threshold
    for k, itl in enumerate(itls):
        value = threshold_of(_step(policy, 5.0 * k, ttft, itl))
        assert value > before or value == policy.params.ceiling
        before = value


@settings(max_examples=60)
@given(
    ttfts=st.lists(st.floats(1.11, 50.0), min_size=1, max_size=20),
    itl=st.floats(0.0, 0.05),
)
def test_ttft_over_target_with_itl_met_lowers_until_the_floor(
    ttfts: list[float], itl: float
) -> None:
    policy = _started()
    before = policy.threshold
    for k, ttft in enumerate(ttfts):
        value = threshold_of(_step(policy, 5.0 * k, ttft, itl))
        assert value < before or value == policy.params.floor
        before = value


@settings(max_examples=60)
@given(
    start=st.integers(-6, 5),
    ttft=st.floats(0.0, 0.89),
    itl=st.floats(0.0, 0.044),
)
def test_with_headroom_it_never_moves_away_from_base(start: int, ttft: float, itl: float) -> None:
    policy = _started()
    policy.threshold = 0.7 + 0.05 * start
    for k in range(30):
        before = abs(policy.threshold - 0.7)
        after = abs(threshold_of(_step(policy, 5.0 * k, ttft, itl)) - 0.7)
        assert after <= before + 1e-12
    assert policy.threshold == pytest.approx(0.7)
