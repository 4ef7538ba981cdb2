"""The prompt-length estimator: prior, calibration, robustness, bounds."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pd_orchestrator.policies import PromptLengthEstimator


def test_the_prior_estimates_before_any_usage() -> None:
    estimator = PromptLengthEstimator(chars_per_token=4.0)
    assert [estimator.estimate("m", c) for c in (0, 1, 2, 4000)] == [0, 1, 1, 1000]
    assert estimator.ratio("m") == 4.0


@settings(max_examples=50)
@given(
    true_ratio=st.floats(1.5, 12.0),
    prior=st.floats(1.0, 16.0),
    sizes=st.lists(st.integers(500, 20_000), min_size=300, max_size=300),
)
def test_calibration_converges_to_the_true_ratio(
    true_ratio: float, prior: float, sizes: list[int]
) -> None:
    estimator = PromptLengthEstimator(chars_per_token=prior, window=100)
    for tokens in sizes:
        estimator.observe("m", round(tokens * true_ratio), tokens)
    assert estimator.ratio("m") == pytest.approx(true_ratio, rel=0.01)
    assert estimator.estimate("m", 40_000) == pytest.approx(40_000 / true_ratio, rel=0.01)


def test_each_model_learns_its_own_ratio() -> None:
    estimator = PromptLengthEstimator()
    for _ in range(200):
        estimator.observe("dense", 3000, 1000)
        estimator.observe("sparse", 6000, 1000)
    assert estimator.ratio("dense") == pytest.approx(3.0, rel=0.01)
    assert estimator.ratio("sparse") == pytest.approx(6.0, rel=0.01)
    assert estimator.ratio("unseen") == 4.0


def test_one_outlier_moves_the_ratio_little() -> None:
    estimator = PromptLengthEstimator(window=100)
    for _ in range(500):
        estimator.observe("m", 4000, 1000)
    estimator.observe("m", 1_000_000, 1)  # a wild report, clipped to 16
    assert estimator.ratio("m") == pytest.approx(4.0 * 4 ** (1 / 100))
    for _ in range(500):
        estimator.observe("m", 4000, 1000)
    assert estimator.ratio("m") == pytest.approx(4.0, rel=1e-3)


@given(chars=st.integers(-5, 10**7), tokens=st.integers(-5, 10**7))
def test_the_ratio_stays_within_its_bounds(chars: int, tokens: int) -> None:
    estimator = PromptLengthEstimator(min_chars_per_token=2.0, max_chars_per_token=8.0)
    for _ in range(30):
        estimator.observe("m", chars, tokens)
    assert 2.0 <= estimator.ratio("m") <= 8.0


def test_observations_are_ignored_when_not_calibrating_or_empty() -> None:
    estimator = PromptLengthEstimator(calibrate=False)
    estimator.observe("m", 1000, 1000)
    assert estimator.ratio("m") == 4.0
    calibrating = PromptLengthEstimator()
    calibrating.observe("m", 0, 10)
    calibrating.observe("m", 10, 0)
    assert calibrating.ratio("m") == 4.0


def test_models_beyond_the_cap_use_the_prior() -> None:
    estimator = PromptLengthEstimator(max_models=1)
    estimator.observe("a", 2000, 1000)
    estimator.observe("b", 2000, 1000)
    assert estimator.ratio("a") < 4.0 and estimator.ratio("b") == 4.0


@pytest.mark.parametrize(
    "kwargs",
    [
        {"chars_per_token": 0.5},
        {"chars_per_token": 20.0},
        {"min_chars_per_token": 0.0},
        {"window": 0},
    ],
    ids=["prior-under-min", "prior-over-max", "zero-min", "zero-window"],
)
def test_inconsistent_settings_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        PromptLengthEstimator(**kwargs)  # type: ignore[arg-type]
