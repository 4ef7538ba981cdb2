"""Profile runs: the pipeline order, clamping and weights, ranking, empty results."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace

import pytest
import yaml

import pd_orchestrator.config.routing as routing_config
from pd_orchestrator.model.endpoints import Role
from pd_orchestrator.model.load import Candidate
from pd_orchestrator.policies.plugins import builtin_registry
from pd_orchestrator.routing import (
    Filter,
    Picker,
    PluginContractError,
    Profile,
    RoutingConfig,
    RoutingRequest,
    ScoredCandidate,
    Stage,
    WeightedScorer,
    build_profiles,
)
from pd_orchestrator.routing.filters import HealthyFilter, HealthyParams, RoleFilter
from pd_orchestrator.routing.pickers import MaxScorePicker
from tests.routing.helpers import candidate, endpoint, load, names, request


@dataclass(frozen=True)
class Fixed:
    """A scorer returning fixed raw scores, whatever the candidates."""

    values: tuple[float, ...]

    def score(self, request: RoutingRequest, candidates: Sequence[Candidate]) -> Sequence[float]:
        return self.values[: len(candidates)]


@dataclass(frozen=True)
class First:
    def pick(self, request: RoutingRequest, scored: Sequence[ScoredCandidate]) -> int:
        return 0


def profile(*scorers: WeightedScorer, picker: Picker | None = None) -> Profile:
    filters: tuple[Stage[Filter], ...] = (
        Stage("healthy", "healthy", HealthyFilter(HealthyParams(panic=False))),
        Stage("role", "role", RoleFilter()),
    )
    chosen = picker if picker is not None else MaxScorePicker(1e-9)
    return Profile("test", filters, scorers, Stage("pick", "test", chosen))


def fixed(name: str, weight: float, *values: float) -> WeightedScorer:
    return WeightedScorer(name, "fixed", weight, Fixed(values))


THREE = [candidate("a"), candidate("b"), candidate("c")]


@pytest.mark.parametrize(
    ("raw", "clamped"),
    [
        ((0.5, 1.5, -0.5), (0.5, 1.0, 0.0)),
        ((math.nan, math.inf, -math.inf), (0.0, 1.0, 0.0)),
        ((0.0, 1.0, 0.25), (0.0, 1.0, 0.25)),
    ],
    ids=["out-of-range", "non-finite", "in-range"],
)
def test_engine_clamps_scores(raw: tuple[float, ...], clamped: tuple[float, ...]) -> None:
    result = profile(fixed("s", 1.0, *raw), picker=First()).run(request(), THREE)
    by_name = {s.endpoint.name: s.scores["s"] for s in result.ranked}
    assert (by_name["a"], by_name["b"], by_name["c"]) == clamped


def test_total_is_the_weighted_sum_of_clamped_scores() -> None:
    result = profile(fixed("x", 2.0, 0.5, 3.0, 0.0), fixed("y", 0.5, 1.0, 0.0, -2.0)).run(
        request(), THREE
    )
    totals = {s.endpoint.name: s.total for s in result.ranked}
    assert totals == {"a": 1.5, "b": 2.0, "c": 0.0}
    assert names([s.candidate for s in result.ranked]) == ["b", "a", "c"]


def test_the_pick_comes_first_then_descending_totals_ties_in_input_order() -> None:
    candidates = [candidate(n) for n in "abcde"]
    result = profile(fixed("s", 1.0, 0.2, 0.9, 0.5, 0.9, 0.1), picker=First()).run(
        request(), candidates
    )
    assert [e.name for e in result.endpoints] == ["a", "b", "d", "c", "e"]
    assert result.pick is not None and result.pick.endpoint.name == "a"


def test_filters_run_in_order_and_count_what_they_drop() -> None:
    candidates = [
        candidate("a", healthy=False),
        candidate("b", Role.PREFILL),
        candidate("c"),
        candidate("d", Role.BOTH),
    ]
    result = profile().run(request(), candidates)
    assert dict(result.dropped) == {"healthy": 1, "role": 1}
    assert sorted(e.name for e in result.endpoints) == ["c", "d"]


def test_nothing_left_is_an_empty_result_saying_why() -> None:
    candidates = [candidate("a", healthy=False), candidate("b", Role.PREFILL)]
    result = profile(picker=First()).run(request(), candidates)
    assert result.empty and result.pick is None and result.endpoints == ()
    assert dict(result.dropped) == {"healthy": 1, "role": 1}
    assert result.describe_drops() == "healthy dropped 1, role dropped 1"


def test_filters_after_an_empty_set_do_not_run() -> None:
    result = profile().run(request(), [candidate("a", healthy=False)])
    assert dict(result.dropped) == {"healthy": 1}


def test_no_candidates_at_all() -> None:
    result = profile().run(request(), [])
    assert result.empty and dict(result.dropped) == {} and result.describe_drops() == ""


def test_without_scorers_the_picker_still_chooses() -> None:
    result = profile().run(request(sequence=1), THREE)
    assert [e.name for e in result.endpoints] == ["b", "a", "c"]
    assert all(s.total == 0.0 and not s.scores for s in result.ranked)


@dataclass(frozen=True)
class Inventing:
    def filter(
        self, request: RoutingRequest, candidates: Sequence[Candidate]
    ) -> Sequence[Candidate]:
        return [*candidates, candidate("intruder")]


@dataclass(frozen=True)
class Beyond:
    def pick(self, request: RoutingRequest, scored: Sequence[ScoredCandidate]) -> int:
        return len(scored)


def test_plugins_that_break_their_contract_are_named() -> None:
    inventing = Profile("t", (Stage("inv", "x", Inventing()),), (), Stage("p", "x", First()))
    with pytest.raises(PluginContractError, match="filter 'inv' returned a new candidate"):
        inventing.run(request(), THREE)
    with pytest.raises(PluginContractError, match="scorer 'short' returned 2 scores for 3"):
        profile(fixed("short", 1.0, 0.1, 0.2)).run(request(), THREE)
    with pytest.raises(PluginContractError, match="picker 'pick' returned index 3 of 3"):
        profile(picker=Beyond()).run(request(), THREE)


def test_default_profiles_prefer_the_least_loaded_healthy_decoder() -> None:
    profiles = build_profiles(RoutingConfig(), builtin_registry())
    candidates = [
        candidate("busy", reading=load(6, 2, 0.2)),
        candidate("down", healthy=False, reading=load(0, 0, 0.0)),
        candidate("idle", reading=load(0, 0, 0.1)),
        candidate("prefill", Role.PREFILL, reading=load(0, 0, 0.0)),
    ]
    result = profiles.decode.run(request(), candidates)
    assert [e.name for e in result.endpoints] == ["idle", "busy"]
    assert result.ranked[0].scores == {"queue-depth": 1.0, "kv-usage": 0.9}


def test_default_prefill_profile_stays_in_the_decoders_group() -> None:
    profiles = build_profiles(RoutingConfig(), builtin_registry())
    candidates = [
        candidate("p-amd", Role.PREFILL, group="mi325x"),
        candidate("p-nv", Role.PREFILL, group="h200", in_flight=3),
    ]
    req = request(Role.PREFILL, decoder=endpoint("d", group="h200"))
    assert [e.name for e in profiles.prefill.run(req, candidates).endpoints] == ["p-nv"]


def test_a_partial_profile_keeps_its_other_defaults() -> None:
    config = RoutingConfig.model_validate({"prefill": {"scorers": [{"type": "kv-usage"}]}})
    prefill = build_profiles(config, builtin_registry()).prefill
    assert [s.name for s in prefill.filters] == ["healthy", "model", "role", "compatibility"]
    assert [s.name for s in prefill.scorers] == ["kv-usage"]
    assert prefill.picker.type == "max-score"


def _documented_yaml() -> str:
    doc = routing_config.__doc__ or ""
    block = doc.split("The YAML::", 1)[1].split("\n\n", 2)[1]
    return re.sub(r"^    ", "", block, flags=re.MULTILINE)


def test_the_documented_yaml_builds() -> None:
    data = yaml.safe_load(_documented_yaml())
    config = RoutingConfig.model_validate(data["routing"])
    profiles = build_profiles(config, builtin_registry())
    decode = profiles.decode
    assert [s.name for s in decode.filters] == ["healthy", "model", "role"]
    assert [(s.name, s.type, s.weight) for s in decode.scorers] == [
        ("queue-depth", "queue-depth", 2.0),
        ("kv-usage", "kv-usage", 1.0),
        ("hw", "hardware-weight", 1.0),
    ]
    assert profiles.prefill.picker.type == "weighted-random"
    candidates = [
        candidate("nv", hardware="h200", reading=load(1, 0, 0.5)),
        candidate("amd", hardware="mi325x", reading=load(1, 0, 0.5)),
    ]
    result = decode.run(request(), candidates)
    assert [e.name for e in result.endpoints] == ["nv", "amd"]
    assert result.ranked[1].scores["hw"] == pytest.approx(0.9)


def test_runs_are_deterministic() -> None:
    data = {"decode": {"picker": {"type": "weighted-random", "params": {"seed": 5}}}}
    config = RoutingConfig.model_validate(data)
    candidates = [candidate(n, reading=load(i, 0, 0.1 * i)) for i, n in enumerate("abcd")]

    def picks() -> list[str]:
        decode = build_profiles(config, builtin_registry()).decode
        return [decode.run(request(sequence=s), candidates).endpoints[0].name for s in range(40)]

    first = picks()
    assert picks() == first and len(set(first)) > 1


def test_totals_are_summed_in_scorer_order_exactly() -> None:
    # floats whose sum depends on the order: the total is 0.0 + w1 * s1 + w2 * s2 + ...
    weights = (1e16, 1.0, -1e16, 3.0)
    raw = [(0.5, 1.0, 0.3), (1.0, 0.7, 0.1), (0.5, 1.0, 0.9), (0.1, 0.2, 0.3)]
    scorers = [fixed(f"s{i}", w, *r) for i, (w, r) in enumerate(zip(weights, raw, strict=True))]
    result = profile(*scorers, picker=First()).run(request(), THREE)
    by_name = {s.endpoint.name: s for s in result.ranked}
    for i, c in enumerate(THREE):
        total = 0.0
        for w, r in zip(weights, raw, strict=True):
            total = total + w * r[i]
        scored = by_name[c.endpoint.name]
        assert scored.total == total and scored.candidate is c
        assert scored.values == tuple(r[i] for r in raw)
        assert scored.scores == {f"s{j}": r[i] for j, r in enumerate(raw)}


def test_what_a_profile_keeps_of_its_plugins_follows_them() -> None:
    @dataclass(frozen=True)
    class TrustedInventing(Inventing):
        trusted = True

    trusting = Profile("t", (Stage("inv", "x", TrustedInventing()),), (), Stage("p", "x", First()))
    assert len(trusting.run(request(), THREE).ranked) == 4  # a trusted filter is not checked
    built = profile(fixed("x", 2.0, 0.1, 0.2, 0.3), fixed("y", 1.0, 0.3, 0.2, 0.1))
    for one in (built, replace(built, filters=built.filters[:1], scorers=built.scorers[1:])):
        assert one._stages == tuple(
            (s.name, s.plugin, bool(getattr(s.plugin, "trusted", False))) for s in one.filters
        )
        assert one._names == tuple(s.name for s in one.scorers)
        assert all(s.names == one._names for s in one.run(request(), THREE).ranked)
    assert replace(built) == built and hash(replace(built)) == hash(built)
