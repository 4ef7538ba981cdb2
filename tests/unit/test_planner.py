"""The planner over the routing pipeline, the ask-all fallback pick, threshold resolution."""

from __future__ import annotations

from typing import Any

import pytest

from pd_orchestrator.config.routing import RoutingConfig
from pd_orchestrator.config.settings import AskAllFallbackConfig
from pd_orchestrator.fleet.endpoints import Endpoint, Role
from pd_orchestrator.flows.ask_all import pick_fallback
from pd_orchestrator.flows.request import ClientRequest
from pd_orchestrator.openai.protocol import CompletionRequest, parse_request
from pd_orchestrator.planner.plan import NoCandidateError, Planner
from pd_orchestrator.policies.base import ThresholdDecision
from pd_orchestrator.routing.builtins import builtin_registry
from pd_orchestrator.routing.profiles import build_profiles
from pd_orchestrator.routing.types import Candidate, LoadSnapshot


def _endpoint(name: str, role: Role, group: str, hardware: str = "h200", **kw: Any) -> Endpoint:
    return Endpoint(name, f"http://{name}:1", role, hardware=hardware, group=group, **kw)


FLEET = [
    _endpoint("hd0", Role.DECODE, "nvidia"),
    _endpoint("hd1", Role.DECODE, "nvidia"),
    _endpoint("ad0", Role.DECODE, "amd", "mi325x"),
    _endpoint("hp0", Role.PREFILL, "nvidia"),
    _endpoint("ap0", Role.PREFILL, "amd", "mi325x"),
    _endpoint("ap-example", Role.PREFILL, "amd", "mi325x", connector="example"),
]


def _request(prompt: str = "hello") -> ClientRequest:
    body = {"model": "m", "prompt": prompt}
    return ClientRequest(
        "completion", "/v1/completions", body, parse_request(CompletionRequest, body), "r", 0.0
    )


def _planner(pairs: frozenset[tuple[str, str]] = frozenset()) -> Planner:
    return Planner(build_profiles(RoutingConfig(), builtin_registry()), pairs)


def _fixed(candidate: Candidate) -> ThresholdDecision:
    return ThresholdDecision(0.5, "static", "fixed")


def test_plan_ranks_only_decoders_and_asks_the_threshold() -> None:
    candidates = [Candidate(e) for e in FLEET]
    plan = _planner().plan(_request(), candidates, 0.0, 0, _fixed)
    assert {e.name for e in plan.decoders} == {"hd0", "hd1", "ad0"}
    assert plan.threshold.value == 0.5


def test_busy_decoders_rank_last() -> None:
    busy = LoadSnapshot(running=30, waiting=10, kv_usage=0.9, observed_at=0.0)
    idle = LoadSnapshot(running=0, waiting=0, kv_usage=0.1, observed_at=0.0)
    candidates = [Candidate(e, load=busy if e.name != "ad0" else idle) for e in FLEET]
    assert _planner().plan(_request(), candidates, 0.0, 0, _fixed).decoder.name == "ad0"


def test_no_healthy_decoder_is_an_error_naming_the_filter() -> None:
    candidates = [Candidate(e, healthy=e.role is Role.PREFILL) for e in FLEET]
    with pytest.raises(NoCandidateError, match="healthy dropped 3"):
        _planner().plan(_request(), candidates, 0.0, 0, _fixed)


@pytest.mark.parametrize(
    ("decoder", "pairs", "expected"),
    [
        ("hd0", frozenset(), {"hp0"}),
        ("ad0", frozenset(), {"ap0"}),
        ("ad0", frozenset({("nvidia", "amd")}), {"ap0", "hp0"}),
        ("hd0", frozenset({("nvidia", "amd")}), {"hp0"}),
    ],
    ids=["same-group", "other-group", "host-staged-pair", "pairs-are-directed"],
)
def test_prefillers_keep_the_decoder_group_and_connector(
    decoder: str, pairs: frozenset[tuple[str, str]], expected: set[str]
) -> None:
    candidates = [Candidate(e) for e in FLEET]
    chosen = next(e for e in FLEET if e.name == decoder)
    names = {e.name for e in _planner(pairs).prefillers(_request(), chosen, candidates, 0.0, 0)}
    assert names == expected


@pytest.mark.parametrize(
    ("pick", "expected"),
    [("least-loaded", "b"), ("most-free-kv", "c"), ("hardware-weight", "c")],
)
def test_fallback_pick(pick: str, expected: str) -> None:
    loads = {
        "a": LoadSnapshot(running=4, waiting=2, kv_usage=0.5, observed_at=0.0),
        "b": LoadSnapshot(running=1, waiting=0, kv_usage=0.8, observed_at=0.0),
        "c": LoadSnapshot(running=3, waiting=0, kv_usage=0.2, observed_at=0.0),
    }
    endpoints = {
        "a": _endpoint("a", Role.DECODE, "g"),
        "b": _endpoint("b", Role.DECODE, "g"),
        "c": _endpoint("c", Role.DECODE, "g", hardware="mi325x"),
    }
    candidates = [Candidate(endpoints[n], load=loads[n]) for n in "abc"]
    config = AskAllFallbackConfig(pick=pick, hardware_weights={"mi325x": 2.0})  # type: ignore[arg-type]
    assert pick_fallback(list(endpoints.values()), candidates, config).name == expected


def test_fallback_ties_keep_the_plan_order() -> None:
    endpoints = [_endpoint(n, Role.DECODE, "g") for n in ("z", "y", "x")]
    candidates = [Candidate(e) for e in endpoints]
    assert pick_fallback(endpoints, candidates, AskAllFallbackConfig()).name == "z"
