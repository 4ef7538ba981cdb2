"""Composite policies (``max``, ``min``, ``weighted``) and per-pool/per-model overrides."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pd_orchestrator.config.policy import PolicySpec
from pd_orchestrator.model.route import Ask, GoPD, Local, Route, Whole, at, threshold_of
from pd_orchestrator.policies import (
    POLICY,
    LatencyObservation,
    OverrideRule,
    OverridesPolicy,
    ThresholdContext,
    build_policy,
)
from pd_orchestrator.policies.base import Leaf
from pd_orchestrator.policies.compose import ExtremePolicy, WeightedPolicy
from pd_orchestrator.policies.goodput import GoodputPolicy
from pd_orchestrator.policies.plugins import builtin_registry
from pd_orchestrator.policies.threshold import ThresholdResolver
from pd_orchestrator.routing import NoParams, PluginContext, PluginType
from tests.policies.helpers import build, context, decoder

MIN_UNCACHED = {"type": "min-uncached-tokens", "params": {"max_uncached_tokens": 1000}}


def _static(value: float, name: str | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"type": "static", "params": {"value": value}}
    if name is not None:
        spec["name"] = name
    return spec


@pytest.mark.parametrize(
    ("kind", "tokens", "value", "policy", "reason"),
    [
        ("max", 500, 0.4, "floor", "fixed"),
        ("max", 10_000, 1 - 999.5 / 10_000, "min-uncached-tokens", "uncached-tokens"),
        ("min", 500, 0.0, "min-uncached-tokens", "short-prompt"),
        ("min", 10_000, 0.4, "floor", "fixed"),
    ],
    ids=["max-short", "max-long", "min-short", "min-long"],
)
def test_max_and_min_keep_the_winning_childs_decision(
    kind: str, tokens: int, value: float, policy: str, reason: str
) -> None:
    composite = build({"type": kind, "params": {"policies": [_static(0.4, "floor"), MIN_UNCACHED]}})
    decision = composite.decide(context(tokens=tokens))
    assert threshold_of(decision) == pytest.approx(value)
    assert (decision.policy, decision.reason) == (policy, reason)


def test_the_first_child_wins_a_tie() -> None:
    composite = build({"type": "max", "params": {"policies": [_static(0.5, "a"), _static(0.5)]}})
    assert composite.decide(context()).policy == "a"


def test_weighted_mean() -> None:
    spec = {
        "type": "weighted",
        "name": "blend",
        "params": {"policies": [_static(0.2), _static(0.8)], "weights": [3, 1]},
    }
    policy = build(spec)
    decision = policy.decide(context())
    assert threshold_of(decision) == pytest.approx(0.35)
    assert (decision.policy, decision.reason) == ("blend", "weighted")
    assert policy.bounds == (pytest.approx(0.35), pytest.approx(0.35))


@given(
    values=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=5),
    weights=st.lists(st.floats(0.01, 10.0), min_size=5, max_size=5),
    tokens=st.integers(0, 50_000),
)
def test_composites_stay_within_their_bounds(
    values: list[float], weights: list[float], tokens: int
) -> None:
    children = [_static(v) for v in values] + [MIN_UNCACHED]
    for spec in (
        {"type": "max", "params": {"policies": children}},
        {"type": "min", "params": {"policies": children}},
        {"type": "weighted", "params": {"policies": children, "weights": weights[: len(children)]}},
    ):
        if len(children) > len(weights):
            continue
        policy = build(spec)
        low, high = policy.bounds
        assert low - 1e-12 <= threshold_of(policy.decide(context(tokens=tokens))) <= high + 1e-12
    assert build({"type": "max", "params": {"policies": children}}).bounds[0] == max(values)


@dataclass
class _Recorder(Leaf):
    """A policy that records what it saw (for routing checks)."""

    value: float
    name: str
    seen: list[str] = field(default_factory=list)

    @property
    def bounds(self) -> tuple[float, float]:
        return (self.value, self.value)

    def decide(self, context: ThresholdContext) -> Route:
        self.seen.append(f"decide {context.pool}/{context.model}")
        return at(self.value, self.name, "recorded")

    def observe(self, observation: LatencyObservation) -> None:
        self.seen.append(f"observe {observation.pool}/{observation.model}")


class _RecorderParams(NoParams):
    value: float = 0.5


def test_composites_forward_every_call_to_every_child() -> None:
    made: list[_Recorder] = []

    def factory(params: _RecorderParams, ctx: PluginContext) -> _Recorder:
        made.append(_Recorder(params.value, ctx.name))
        return made[-1]

    registry = builtin_registry()
    registry.register(PluginType("recorder", POLICY, _RecorderParams, factory))
    spec = {"type": "min", "params": {"policies": [{"type": "recorder"}, {"type": "recorder"}]}}
    composite = build_policy(registry, PolicySpec.model_validate(spec), "threshold.policy")
    composite.decide(context())
    composite.observe(LatencyObservation("m", "decode", 1.0, ttft=0.1))
    assert [r.seen for r in made] == [["decide decode/m", "observe decode/m"]] * 2


def _layer() -> tuple[OverridesPolicy, dict[str, _Recorder]]:
    policies = {n: _Recorder(v, n) for n, v in [("default", 0.1), ("pool", 0.2), ("model", 0.3),
                                                ("both", 0.4)]}  # fmt: skip
    layer = OverridesPolicy(
        policies["default"],
        (
            OverrideRule(policies["model"], model="big"),
            OverrideRule(policies["both"], pool="h200", model="big"),
            OverrideRule(policies["pool"], pool="h200"),
        ),
    )
    return layer, policies


@pytest.mark.parametrize(
    ("pool", "model", "chosen"),
    [
        ("h200", "big", "both"),
        ("h200", "small", "pool"),
        ("mi325x", "big", "model"),
        ("mi325x", "small", "default"),
    ],
    ids=["pool-and-model", "pool-only", "model-only", "no-match"],
)
def test_the_most_specific_override_decides_and_observes(
    pool: str, model: str, chosen: str
) -> None:
    layer, policies = _layer()
    decision = layer.decide(context(dec=decoder(pool=pool), model=model))
    assert decision.policy == chosen
    layer.observe(LatencyObservation(model, pool, 1.0, itl=0.01))
    assert policies[chosen].seen == [f"decide {pool}/{model}", f"observe {pool}/{model}"]
    assert all(not p.seen for name, p in policies.items() if name != chosen)
    assert layer.bounds == (0.1, 0.4)


def test_overrides_as_a_policy_type_nest_in_a_composite() -> None:
    spec = {
        "type": "max",
        "params": {
            "policies": [
                _static(0.3),
                {
                    "type": "overrides",
                    "params": {
                        "default": _static(0.1),
                        "rules": [{"pool": "h200", "policy": _static(0.9, "h200-only")}],
                    },
                },
            ]
        },
    }
    policy = build(spec)
    assert policy.decide(context(dec=decoder(pool="h200"))).policy == "h200-only"
    assert threshold_of(policy.decide(context(dec=decoder(pool="other")))) == 0.3


@dataclass
class _Says(Leaf):
    """A policy that answers ``route``."""

    route: Route
    name: str = "says"
    bounds: tuple[float, float] = (0.0, 1.0)

    def decide(self, context: ThresholdContext) -> Route:
        return self.route

    def observe(self, observation: LatencyObservation) -> None:
        return None


DRAIN = GoPD("goodput", "drain", "d1")
SPILL = Whole("goodput", "spill", "p1")


def test_max_and_min_keep_a_route_that_is_not_a_threshold_whole_weighted_keeps_its_number() -> None:
    half = _Says(Ask(0.5, "static", "fixed"))
    # max and min order the children by the threshold each sends and keep one whole
    assert ExtremePolicy((half, _Says(DRAIN)), True, "max").decide(context()) == DRAIN
    assert ExtremePolicy((half, _Says(DRAIN)), False, "min").decide(context()) == half.route
    assert ExtremePolicy((half, _Says(SPILL)), False, "min").decide(context()) == SPILL
    # weighted averages the thresholds (P/D at once 1, served whole 0) and names no one
    blend = WeightedPolicy((_Says(DRAIN), _Says(SPILL)), (1.0, 1.0), "blend")
    assert blend.decide(context()) == Ask(0.5, "blend", "weighted")
    assert WeightedPolicy((_Says(SPILL),), (1.0,)).decide(context()) == Local(
        "weighted", "weighted"
    )


def _goodput_in(kind: str, other: float, *, cached: int | None = None) -> tuple[Route, float]:
    """``kind`` of goodput and static ``other``, decided and told its route for a
    2,000-token prompt on a decoder with streams running (goodput alone keeps it
    local); the route and what goodput's duty cycle counts at the decoder."""
    goodput = build({"type": "goodput"})
    assert isinstance(goodput, GoodputPolicy)
    composite = ExtremePolicy((goodput, build(_static(other))), kind == "max", kind)
    resolver = ThresholdResolver(composite)
    asked = context(tokens=2_000, dec=decoder(in_flight=8), cached=cached)
    assert goodput.decide(asked) == Local("goodput", "local")
    route = resolver.decide(asked)
    resolver.chosen(asked, route)
    duty = goodput.model.duty.get("d0")
    return route, 0.0 if duty is None else duty.tokens


def test_goodput_inside_max_counts_in_its_duty_cycle_only_what_the_composite_kept() -> None:
    # max takes static's 0.9: the cold prompt is not admitted, nothing was kept there
    route, kept = _goodput_in("max", 0.9)
    assert route == Ask(0.9, "static", "fixed") and kept == 0.0
    # static 1: P/D at once, nothing kept
    assert _goodput_in("max", 1.0) == (GoPD("static", "fixed"), 0.0)
    # a prompt the decoder holds 1,900 of meets 0.9: its 100 uncached tokens are kept
    assert _goodput_in("max", 0.9, cached=1_900) == (Ask(0.9, "static", "fixed"), 100.0)
    # min takes goodput's own route: it keeps what it would keep alone
    assert _goodput_in("min", 0.9) == (Local("goodput", "local"), 2_000.0)


SLO_FEEDBACK = {"type": "slo-feedback", "params": {"ttft_p90": 1.0, "itl_p99": 0.05}}


@pytest.mark.parametrize(
    ("spec", "observes"),
    [
        (_static(0.7), False),
        (MIN_UNCACHED, False),
        ({"type": "goodput"}, True),
        (SLO_FEEDBACK, True),
        ({"type": "max", "params": {"policies": [_static(0.4), MIN_UNCACHED]}}, False),
        ({"type": "min", "params": {"policies": [_static(0.4), SLO_FEEDBACK]}}, True),
        (
            {
                "type": "overrides",
                "params": {
                    "default": _static(0.1),
                    "rules": [{"pool": "h200", "policy": {"type": "goodput"}}],
                },
            },
            True,
        ),
    ],
    ids=["static", "min-uncached", "goodput", "slo-feedback", "max-of-two", "min-with-slo", "rule"],
)
def test_a_configuration_observes_latencies_when_one_of_its_policies_does(
    spec: dict[str, Any], observes: bool
) -> None:
    """The resolver builds no latency sample for a configuration none of whose policies
    learns from one (``observes``); any that does, however nested, makes it observe."""
    assert ThresholdResolver(build(spec)).observes is observes
