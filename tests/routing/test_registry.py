"""The plugin registry and profile building: errors name the culprit."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

from pd_orchestrator.model.load import Candidate
from pd_orchestrator.policies.plugins import builtin_registry
from pd_orchestrator.routing import (
    FILTER,
    PICKER,
    SCORER,
    NoParams,
    PluginContext,
    PluginKind,
    PluginSpec,
    PluginType,
    ProfileConfig,
    Registry,
    RoutingConfig,
    RoutingConfigError,
    RoutingRequest,
    Scorer,
    build_profile,
    build_profiles,
)
from pd_orchestrator.routing.filters import HEALTHY


def build(profile: dict[str, Any], registry: Registry | None = None) -> None:
    config = RoutingConfig.model_validate({"decode": profile})
    build_profiles(config, registry or builtin_registry())


@pytest.mark.parametrize(
    ("profile", "kind", "plugin", "fragment"),
    [
        (
            {"filters": [{"type": "healthy", "params": {"bogus": 1}}]},
            "filter",
            "healthy",
            "params.bogus: unknown field",
        ),
        (
            {"scorers": [{"type": "hardware-weight", "name": "hw", "params": {"weigths": {}}}]},
            "scorer",
            "hw",
            "(type 'hardware-weight'): params.weigths: unknown field",
        ),
        (
            {"scorers": [{"type": "hardware-weight", "params": {"weights": {"h200": -1}}}]},
            "scorer",
            "hardware-weight",
            "params.weights.h200: Input should be greater than or equal to 0",
        ),
        (
            {"scorers": [{"type": "queue-lenght"}]},
            "scorer",
            "queue-lenght",
            "unknown scorer type 'queue-lenght' (known: approximate-prefix, hardware-weight, "
            "kv-usage, precise-prefix, prefix-affinity, queue-depth)",
        ),
        ({"picker": {"type": "round-robin"}}, "picker", "round-robin", "unknown picker type"),
        (
            {"filters": [{"type": "hardware-weight"}]},
            "filter",
            "hardware-weight",
            "'hardware-weight' is a scorer type",
        ),
        (
            {"picker": {"type": "weighted-random", "params": {"seed": "x"}}},
            "picker",
            "weighted-random",
            "params.seed",
        ),
        (
            {"scorers": [{"type": "queue-depth", "params": {"scale": 2}}]},
            "scorer",
            "queue-depth",
            "params.scale: unknown field",
        ),
    ],
    ids=[
        "unknown-filter-param",
        "unknown-scorer-param-named-instance",
        "invalid-param-value",
        "unknown-scorer-type",
        "unknown-picker-type",
        "type-of-another-kind",
        "wrong-param-type",
        "param-of-paramless-plugin",
    ],
)
def test_build_errors_name_profile_kind_and_plugin(
    profile: dict[str, Any], kind: str, plugin: str, fragment: str
) -> None:
    with pytest.raises(RoutingConfigError) as info:
        build(profile)
    error = info.value
    assert (error.profile, error.kind, error.plugin) == ("decode", kind, plugin)
    message = str(error)
    assert message.startswith(f"routing profile 'decode', {kind} {plugin!r}")
    assert fragment in message


@pytest.mark.parametrize(
    ("profile", "duplicate"),
    [
        ({"scorers": [{"type": "kv-usage"}, {"type": "kv-usage", "weight": 2}]}, "'kv-usage'"),
        ({"scorers": [{"type": "kv-usage", "name": "healthy"}]}, "'healthy'"),
        ({"picker": {"type": "max-score", "name": "role"}}, "'role'"),
    ],
    ids=["two-scorers-of-a-type", "scorer-named-like-a-filter", "picker-named-like-a-filter"],
)
def test_duplicate_names_are_config_errors(profile: dict[str, Any], duplicate: str) -> None:
    with pytest.raises(ValidationError) as info:
        RoutingConfig.model_validate({"prefill": profile})
    assert f"profile 'prefill': duplicate plugin name(s) {duplicate}" in str(info.value)


def test_duplicate_names_are_build_errors_too() -> None:
    config = ProfileConfig.model_construct(
        filters=[PluginSpec(type="healthy")],
        scorers=[],
        picker=PluginSpec(type="max-score", name="healthy"),
    )
    with pytest.raises(RoutingConfigError, match="profile 'x', filter 'healthy': duplicate"):
        build_profile("x", config, builtin_registry())


def test_named_instances_of_one_type_build() -> None:
    build(
        {
            "scorers": [
                {"type": "hardware-weight", "name": "hw-a", "params": {"weights": {"h200": 1}}},
                {"type": "hardware-weight", "name": "hw-b", "weight": 0.5},
            ]
        }
    )


@pytest.mark.parametrize(
    "data",
    [
        {"decode": {"filterz": []}},
        {"decode": {"scorers": [{"type": "kv-usage", "wieght": 2}]}},
        {"decode": {"scorers": [{"type": "kv-usage", "weight": -1}]}},
        {"decode": {"filters": [{"type": "healthy", "weight": 1}]}},
        {"decode": {"picker": {"type": "max score"}}},
        {"ask_all": {}},
    ],
    ids=[
        "profile-key",
        "scorer-key",
        "negative-weight",
        "weight-on-filter",
        "bad-type-name",
        "profile",
    ],
)
def test_config_shape_is_strict(data: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        RoutingConfig.model_validate(data)


def test_registering_a_type_twice_is_an_error() -> None:
    registry = builtin_registry()
    with pytest.raises(ValueError, match="filter type 'healthy' is already registered"):
        registry.register(HEALTHY)


@dataclass(frozen=True)
class _KeepAll:
    def filter(
        self, request: RoutingRequest, candidates: Sequence[Candidate]
    ) -> Sequence[Candidate]:
        return candidates


def _keep_all(params: BaseModel, context: PluginContext) -> _KeepAll:
    return _KeepAll()


class _Loose(BaseModel):
    value: int = 0


def test_params_models_must_forbid_unknown_fields() -> None:
    with pytest.raises(ValueError, match="'loose': its params model must forbid extra fields"):
        Registry([PluginType("loose", FILTER, _Loose, _keep_all)])


def test_a_factory_value_error_names_the_plugin() -> None:
    def refuse(params: NoParams, context: PluginContext) -> Scorer:
        raise ValueError("not on this hardware")

    registry = builtin_registry()
    registry.register(PluginType("picky", SCORER, NoParams, refuse))
    with pytest.raises(RoutingConfigError) as info:
        build({"scorers": [{"type": "picky", "name": "p"}]}, registry)
    assert str(info.value).endswith("scorer 'p' (type 'picky'): not on this hardware")


class _PolicyParams(NoParams):
    value: float = 0.5


@dataclass(frozen=True)
class _Policy:
    value: float
    where: PluginContext


def _policy(params: _PolicyParams, context: PluginContext) -> _Policy:
    return _Policy(params.value, context)


def test_new_plugin_kinds_use_the_same_registry() -> None:
    policy_kind: PluginKind[_Policy] = PluginKind("policy")
    registry = builtin_registry()
    registry.register(PluginType("fixed", policy_kind, _PolicyParams, _policy))
    spec = PluginSpec.model_validate({"type": "fixed", "params": {"value": 0.8}})
    assert registry.build(policy_kind, spec, "decode") == _Policy(
        0.8, PluginContext("decode", "fixed")
    )
    assert "fixed" in registry.names(policy_kind)
    typo = PluginSpec.model_validate({"type": "fixed", "params": {"valeu": 1}})
    with pytest.raises(RoutingConfigError) as info:
        registry.build(policy_kind, typo, "decode")
    assert str(info.value) == (
        "routing profile 'decode', policy 'fixed': params.valeu: unknown field"
    )


def test_builtin_registry_lists_each_kind() -> None:
    registry = builtin_registry()
    assert registry.names(FILTER) == ["compatibility", "healthy", "model", "role"]
    assert registry.names(SCORER) == [
        "approximate-prefix",
        "hardware-weight",
        "kv-usage",
        "precise-prefix",
        "prefix-affinity",
        "queue-depth",
    ]
    assert registry.names(PICKER) == ["max-score", "weighted-random"]


def test_every_call_returns_a_new_registry() -> None:
    builtin_registry().register(PluginType("extra", FILTER, NoParams, _keep_all))
    assert "extra" not in builtin_registry().names(FILTER)
