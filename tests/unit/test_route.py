"""The route a policy answers: what each kind sends, and the thresholds it accepts."""

from __future__ import annotations

import pytest

from pd_orchestrator.model.route import Ask, Decline, GoPD, Local, Whole, at, threshold_of


@pytest.mark.parametrize(
    ("threshold", "route"),
    [
        (0.0, Local("p", "r")),
        (0.25, Ask(0.25, "p", "r")),
        (1.0, GoPD("p", "r")),
    ],
    ids=["zero-is-local", "between-asks", "one-is-p-d-now"],
)
def test_a_threshold_is_the_route_that_sends_it(threshold: float, route: object) -> None:
    made = at(threshold, "p", "r")
    assert made == route and threshold_of(made) == threshold


def test_every_route_sends_a_threshold() -> None:
    assert threshold_of(Whole("p", "spill", "p1")) == 0.0  # the prefiller admits it
    assert threshold_of(Decline("p", "declined")) == 1.0  # none admits it there


@pytest.mark.parametrize("threshold", [0.0, 1.0, -0.1, 1.5, float("nan")])
def test_an_asked_threshold_lies_strictly_between_zero_and_one(threshold: float) -> None:
    with pytest.raises(ValueError, match="lies in"):
        Ask(threshold, "p", "r")


@pytest.mark.parametrize("threshold", [-0.1, 1.5])
def test_a_threshold_outside_zero_to_one_is_no_route(threshold: float) -> None:
    with pytest.raises(ValueError, match="outside"):
        at(threshold, "p", "r")
