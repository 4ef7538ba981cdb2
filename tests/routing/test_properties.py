"""Properties of routing over arbitrary fleets and configurations (hypothesis)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hypothesis import given
from hypothesis import strategies as st

from pd_orchestrator.model.endpoints import Endpoint, Role
from pd_orchestrator.model.load import Candidate, LoadSnapshot
from pd_orchestrator.policies.plugins import builtin_registry
from pd_orchestrator.routing import (
    PluginSpec,
    Profile,
    RoutingConfig,
    RoutingRequest,
    Stage,
    WeightedScorer,
    build_profiles,
)
from pd_orchestrator.routing.pickers import MaxScorePicker
from pd_orchestrator.routing.registry import FILTER, SCORER

GROUPS = ["h200", "mi325x", "other"]
HARDWARE = ["h200", "mi325x", "tpu"]

loads = st.builds(
    LoadSnapshot,
    running=st.integers(0, 500),
    waiting=st.integers(0, 500),
    kv_usage=st.floats(0.0, 1.0),
    observed_at=st.floats(0.0, 100.0),
    prefix_hit_rate=st.none() | st.floats(0.0, 1.0),
    preemptions=st.integers(0, 10),
)


@st.composite
def fleets(draw: st.DrawFn, min_size: int = 0) -> list[Candidate]:
    size = draw(st.integers(min_size, 8))
    return [
        Candidate(
            Endpoint(
                f"e{i}",
                f"http://e{i}:1",
                draw(st.sampled_from(list(Role))),
                draw(st.sampled_from(HARDWARE)),
                draw(st.sampled_from([None, "m", "n"])),
                group=draw(st.sampled_from(GROUPS)),
            ),
            draw(st.booleans()),
            draw(st.integers(0, 50)),
            draw(st.none() | loads),
        )
        for i in range(size)
    ]


pairs = st.frozensets(st.tuples(st.sampled_from(GROUPS), st.sampled_from(GROUPS)), max_size=4)
requests = st.builds(
    RoutingRequest,
    role=st.sampled_from(list(Role)),
    now=st.floats(0.0, 200.0),
    model=st.sampled_from([None, "m", "n"]),
    affinity_key=st.none() | st.text(max_size=8),
    decoder=st.none()
    | st.builds(
        Endpoint,
        name=st.just("d"),
        url=st.just("http://d:1"),
        role=st.just(Role.DECODE),
        group=st.sampled_from(GROUPS),
    ),
    allowed_pairs=pairs,
    sequence=st.integers(0, 10_000),
)

scorer_specs = st.sampled_from(
    [
        {"type": "queue-depth"},
        {"type": "kv-usage", "params": {"missing": 0.3}},
        {"type": "hardware-weight", "params": {"weights": {"h200": 3.0, "mi325x": 0.5}}},
        {"type": "hardware-weight", "params": {"weights": {"tpu": 0.0}, "default": 0.0}},
    ]
)


@given(fleets(), requests, scorer_specs)
def test_builtin_scores_are_within_0_and_1(
    fleet: list[Candidate], request: RoutingRequest, spec: dict[str, object]
) -> None:
    scorer = builtin_registry().build(SCORER, PluginSpec.model_validate(spec), "p")
    raw = scorer.score(request, fleet)
    assert len(raw) == len(fleet) and all(0.0 <= s <= 1.0 for s in raw)


@dataclass(frozen=True)
class Arbitrary:
    values: tuple[float, ...]

    def score(self, request: RoutingRequest, candidates: Sequence[Candidate]) -> Sequence[float]:
        return [self.values[i % len(self.values)] for i in range(len(candidates))]


@given(
    fleets(min_size=1),
    requests,
    st.lists(st.floats(allow_nan=True, allow_infinity=True), min_size=1, max_size=5),
    st.floats(0.0, 10.0),
)
def test_engine_scores_are_clamped_whatever_the_scorer_returns(
    fleet: list[Candidate], request: RoutingRequest, values: list[float], weight: float
) -> None:
    scorer = WeightedScorer("any", "any", weight, Arbitrary(tuple(values)))
    profile = Profile("p", (), (scorer,), Stage("max", "max-score", MaxScorePicker(1e-9)))
    for scored in profile.run(request, fleet).ranked:
        assert 0.0 <= scored.scores["any"] <= 1.0
        assert 0.0 <= scored.total <= weight


def _routing(picker: dict[str, object], scorers: list[dict[str, object]]) -> RoutingConfig:
    profile = {
        "filters": [{"type": "healthy"}, {"type": "model"}, {"type": "role"}],
        "scorers": [{**s, "name": f"s{i}", "weight": 1 + i} for i, s in enumerate(scorers)],
        "picker": picker,
    }
    return RoutingConfig.model_validate({"decode": profile, "prefill": profile})


@given(
    fleets(),
    requests,
    st.sampled_from(
        [
            {"type": "max-score"},
            {"type": "max-score", "params": {"tolerance": 0.5}},
            {"type": "weighted-random", "params": {"seed": 1}},
        ]
    ),
    st.lists(scorer_specs, max_size=3),
)
def test_the_pick_is_a_candidate_that_passed_the_filters(
    fleet: list[Candidate],
    request: RoutingRequest,
    picker: dict[str, object],
    scorers: list[dict[str, object]],
) -> None:
    profile = build_profiles(_routing(picker, scorers), builtin_registry()).decode
    result = profile.run(request, fleet)
    healthy = [c for c in fleet if c.healthy] or fleet  # none healthy: panic keeps all
    passed = [
        c
        for c in healthy
        if (request.model is None or c.endpoint.model in (None, request.model))
        and (request.role is Role.BOTH or c.endpoint.role in (request.role, Role.BOTH))
    ]
    assert result.empty == (not passed)
    assert sorted(id(s.candidate) for s in result.ranked) == sorted(id(c) for c in passed)
    if passed:
        assert result.pick is not None and any(result.pick.candidate is c for c in passed)
        rest = [s.total for s in result.ranked[1:]]
        assert rest == sorted(rest, reverse=True)


@given(fleets(), requests, pairs)
def test_compatibility_never_pairs_undeclared_groups(
    fleet: list[Candidate], request: RoutingRequest, configured: frozenset[tuple[str, str]]
) -> None:
    params = {"pairs": [{"prefill": p, "decode": d} for p, d in sorted(configured)]}
    spec = PluginSpec.model_validate({"type": "compatibility", "params": params})
    kept = builtin_registry().build(FILTER, spec, "prefill").filter(request, fleet)
    decoder = request.decoder
    if decoder is None:
        assert list(kept) == fleet
        return
    allowed = configured | request.allowed_pairs
    for c in kept:
        assert c.endpoint.group == decoder.group or (c.endpoint.group, decoder.group) in allowed
    dropped = [c for c in fleet if not any(c is k for k in kept)]
    for c in dropped:
        assert c.endpoint.group != decoder.group
        assert (c.endpoint.group, decoder.group) not in allowed
