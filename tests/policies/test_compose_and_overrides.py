"""Composite policies (``max``, ``min``, ``weighted``) and per-pool/per-model overrides."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pd_orchestrator.config.policy import PolicySpec
from pd_orchestrator.policies import (
    POLICY,
    LatencyObservation,
    OverrideRule,
    OverridesPolicy,
    ThresholdContext,
    ThresholdDecision,
    build_policy,
)
from pd_orchestrator.policies.plugins import builtin_registry
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
    assert decision.value == pytest.approx(value)
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
    assert decision.value == pytest.approx(0.35)
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
        assert low - 1e-12 <= policy.decide(context(tokens=tokens)).value <= high + 1e-12
    assert build({"type": "max", "params": {"policies": children}}).bounds[0] == max(values)


@dataclass
class _Recorder:
    """A policy that records what it saw (for routing checks)."""

    value: float
    name: str
    seen: list[str] = field(default_factory=list)

    @property
    def bounds(self) -> tuple[float, float]:
        return (self.value, self.value)

    def decide(self, context: ThresholdContext) -> ThresholdDecision:
        self.seen.append(f"decide {context.pool}/{context.model}")
        return ThresholdDecision(self.value, self.name, "recorded")

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
    assert policy.decide(context(dec=decoder(pool="other"))).value == 0.3
