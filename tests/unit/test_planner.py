"""The decode-first planner (pure); threshold policies are tested in tests/policies."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from pd_orchestrator.fleet.endpoints import Endpoint, Role
from pd_orchestrator.fleet.state import EndpointStatus
from pd_orchestrator.planner.decode_first import order_candidates, plan_decode_first
from pd_orchestrator.policies.base import ThresholdDecision


def _status(name: str, healthy: bool = True, in_flight: int = 0) -> EndpointStatus:
    return EndpointStatus(Endpoint(name, f"http://{name}:1", Role.DECODE), healthy, in_flight)


def _names(statuses: tuple[EndpointStatus, ...]) -> list[str]:
    return [s.endpoint.name for s in statuses]


def test_healthy_before_unhealthy_then_least_loaded() -> None:
    statuses = [_status("a", False), _status("b", in_flight=3), _status("c", in_flight=1)]
    assert _names(order_candidates(statuses, turn=0)) == ["c", "b", "a"]


def test_ties_rotate_with_the_turn() -> None:
    statuses = [_status("a"), _status("b"), _status("c")]
    firsts = {_names(order_candidates(statuses, turn))[0] for turn in range(3)}
    assert firsts == {"a", "b", "c"}


def test_affinity_is_stable_and_spreads_keys() -> None:
    statuses = [_status(n) for n in "abcd"]
    chosen = {
        _names(order_candidates(statuses, t, f"conversation-{k}"))[0]
        for t in range(3)
        for k in range(40)
    }
    assert len(chosen) == 4  # keys spread over every decoder
    for k in range(10):
        picks = {_names(order_candidates(statuses, t, f"c{k}"))[0] for t in range(5)}
        assert len(picks) == 1  # the same key always goes to the same decoder


def test_affinity_yields_to_load_beyond_the_slack() -> None:
    key = "conversation"
    statuses = [_status(n) for n in "abc"]
    preferred = _names(order_candidates(statuses, 0, key))[0]
    loaded = [_status(n, in_flight=5 if n == preferred else 0) for n in "abc"]
    assert _names(order_candidates(loaded, 0, key, slack=2))[0] != preferred


@given(
    st.lists(st.tuples(st.booleans(), st.integers(0, 9)), min_size=1, max_size=8),
    st.integers(0, 50),
)
def test_order_is_a_permutation_with_healthy_first(spec: list[tuple[bool, int]], turn: int) -> None:
    statuses = [_status(f"e{i}", h, n) for i, (h, n) in enumerate(spec)]
    ordered = order_candidates(statuses, turn, "key")
    assert sorted(_names(ordered)) == sorted(_names(tuple(statuses)))
    health = [s.healthy for s in ordered]
    assert health == sorted(health, reverse=True)


def test_plan_asks_the_threshold_about_the_chosen_decoder() -> None:
    seen: list[str] = []

    def threshold(status: EndpointStatus) -> ThresholdDecision:
        seen.append(status.endpoint.name)
        return ThresholdDecision(0.4, "static", "fixed")

    plan = plan_decode_first([_status("a", in_flight=2), _status("b")], [], 0, threshold)
    assert plan.decoder.name == "b" and seen == ["b"] and plan.threshold.value == 0.4
