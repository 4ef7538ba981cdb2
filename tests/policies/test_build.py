"""The ``threshold:`` block: shape, building through the registry, errors, resolution."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from pd_orchestrator.config import ConfigError, load_config, parse_config
from pd_orchestrator.config.policy import ThresholdConfig
from pd_orchestrator.model.route import threshold_of
from pd_orchestrator.policies import (
    CLIENT,
    LatencyObservation,
    OverridesPolicy,
    PolicyConfigError,
    SloFeedbackPolicy,
    StaticPolicy,
    ThresholdResolver,
    build_threshold,
)
from pd_orchestrator.policies.plugins import builtin_registry
from pd_orchestrator.routing import RoutingConfigError
from tests.policies.helpers import context, decoder

CONFIGS = sorted(Path(__file__).resolve().parents[2].joinpath("configs").glob("*.yaml"))
FLEET: dict[str, Any] = {
    "decoders": [{"name": "d0", "url": "http://127.0.0.1:9001"}],
    "prefillers": [{"name": "p0", "url": "http://127.0.0.1:9002"}],
}


def _threshold(block: dict[str, Any], pools: set[str] | None = None) -> ThresholdResolver:
    config = ThresholdConfig.model_validate(block)
    return build_threshold(config, builtin_registry(), pools=pools)


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_shipped_config_builds_its_threshold(path: Path) -> None:
    config = load_config(path)
    pools = {pool.name for pool in config.pools}
    resolver = build_threshold(config.threshold, builtin_registry(), pools=pools)
    assert 0.0 <= threshold_of(resolver.decide(context())) <= 1.0


def test_the_legacy_static_shape_still_reads() -> None:
    resolver = _threshold({"policy": {"type": "static", "value": 0.5}, "honour_client": False})
    assert resolver.policy == StaticPolicy(0.5)
    assert resolver.honour_client is False
    assert _threshold({}).policy == StaticPolicy(0.7)


def test_the_documented_example_builds() -> None:
    block = yaml.safe_load(
        """
        policy:
          type: load-adaptive
          name: adaptive
          params: {base: 0.7, floor: 0.3, ceiling: 0.95}
        overrides:
          - {pool: h200-decode, policy: {type: min-uncached-tokens}}
          - {model: big, policy: {type: static, value: 0.9}}
          - pool: mi325x-decode
            model: small
            policy:
              type: max
              params:
                policies:
                  - {type: min-uncached-tokens, params: {max_uncached_tokens: 1024}}
                  - {type: slo-feedback, params: {ttft_p90: 0.5, itl_p99: 0.05}}
        honour_client: true
        prompt_length: {chars_per_token: 3.5, calibrate: true, exact: true}
        """
    )
    resolver = _threshold(block, pools={"h200-decode", "mi325x-decode", "prefill"})
    assert isinstance(resolver.policy, OverridesPolicy)
    assert resolver.exact_prompt_length is True
    assert resolver.estimate_tokens("any", 35) == 10
    pick = resolver.decide(context(dec=decoder(pool="h200-decode"), tokens=100))
    assert (pick.policy, pick.reason) == ("min-uncached-tokens", "short-prompt")
    assert threshold_of(resolver.decide(context(dec=decoder(pool="x"), model="big"))) == 0.9
    assert resolver.decide(context(dec=decoder(pool="x"))).policy == "adaptive"


@pytest.mark.parametrize(
    ("block", "message"),
    [
        (
            {"policy": {"type": "load-adaptiv"}},
            "threshold.policy: policy 'load-adaptiv': unknown policy type 'load-adaptiv' "
            "(known: dynamo, dynamo-legacy, goodput, llm-d, load-adaptive, max, min, "
            "min-uncached-tokens, overrides, slo-feedback, static, weighted)",
        ),
        (
            {"policy": {"type": "load-adaptive", "params": {"rise": 0.1}}},
            "threshold.policy: policy 'load-adaptive': params.rise: unknown field",
        ),
        (
            {"policy": {"type": "load-adaptive", "name": "busy", "params": {"floor": "low"}}},
            "threshold.policy: policy 'busy' (type 'load-adaptive'): params.floor: "
            "Input should be a valid number, unable to parse string as a number",
        ),
        (
            {"policy": {"type": "queue-depth"}},
            "'queue-depth' is a scorer type",
        ),
        (
            {
                "policy": {
                    "type": "max",
                    "params": {"policies": [{"type": "static"}, {"type": "slo-feedback"}]},
                }
            },
            "threshold.policy.params.policies[1]: policy 'slo-feedback': params: "
            "Value error, set at least one target",
        ),
        (
            {"policy": {"type": "max", "params": {"policies": []}}},
            "threshold.policy: policy 'max': params.policies: List should have at least 1 item",
        ),
        (
            {"policy": {"type": "weighted", "params": {"policies": [{}], "weights": [0]}}},
            "threshold.policy: policy 'weighted': params: Value error, the weights must not",
        ),
        (
            {"overrides": [{"model": "m", "policy": {"type": "static", "params": {"v": 1}}}]},
            "threshold.overrides[0].policy: policy 'static': params.v: unknown field",
        ),
        (
            {
                "policy": {
                    "type": "overrides",
                    "params": {"rules": [{"pool": "a", "policy": {"type": "nope"}}]},
                }
            },
            "threshold.policy.params.rules[0].policy: policy 'nope': unknown policy type",
        ),
        (
            {"overrides": [{"pool": "h100", "policy": {"type": "static"}}]},
            "threshold.overrides[0]: policy 'static': unknown pool 'h100' (known: decode, prefill)",
        ),
    ],
    ids=[
        "unknown-type",
        "unknown-param",
        "bad-param-of-named-instance",
        "type-of-another-kind",
        "nested-child-names-its-own-place",
        "empty-composite",
        "zero-weights",
        "override-param",
        "nested-override-rule",
        "unknown-pool",
    ],
)
def test_build_errors_name_the_place_and_the_policy(block: dict[str, Any], message: str) -> None:
    with pytest.raises(PolicyConfigError) as info:
        _threshold(block, pools={"decode", "prefill"})
    assert str(info.value).startswith(message) or message in str(info.value)
    assert isinstance(info.value, RoutingConfigError) and info.value.kind == "policy"


@pytest.mark.parametrize(
    ("threshold", "fragment"),
    [
        ({"policy": {"type": "static", "value": 1.5}}, "threshold.policy.value"),
        ({"policy": {"type": "min", "value": 0.5}}, "a 'min' policy takes `params`"),
        ({"policy": {"value": 0.5, "params": {"value": 0.4}}}, "give the static value once"),
        ({"overrides": [{"policy": {}}]}, "an override needs a `pool`, a `model` or both"),
        (
            {"overrides": [{"pool": "a", "policy": {}}, {"pool": "a", "policy": {}}]},
            "more than one override for pool 'a'",
        ),
        ({"prompt_length": {"chars_per_token": 30}}, "outside [min_chars_per_token"),
        ({"polcy": {}}, "threshold.polcy: unknown key"),
    ],
    ids=[
        "legacy-range",
        "shorthand-on-another-type",
        "value-twice",
        "override-without-selector",
        "duplicate-override",
        "ratio-outside-bounds",
        "typo",
    ],
)
def test_shape_errors_at_load_time(threshold: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(FLEET | {"threshold": threshold})
    assert fragment in str(info.value)


def test_the_environment_overrides_the_static_shorthand(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDO_THRESHOLD__POLICY__VALUE", "0.25")
    config = parse_config(FLEET)
    resolver = build_threshold(config.threshold, builtin_registry())
    assert threshold_of(resolver.decide(context())) == 0.25


@pytest.mark.parametrize(
    ("honour", "client", "value", "policy"),
    [
        (True, 0.9, 0.9, CLIENT),
        (True, 0.0, 0.0, CLIENT),
        (True, None, 0.3, "static"),
        (False, 0.9, 0.3, "static"),
    ],
    ids=["honoured", "honoured-zero", "absent", "not-honoured"],
)
def test_honour_client(honour: bool, client: float | None, value: float, policy: str) -> None:
    resolver = _threshold({"policy": {"value": 0.3}, "honour_client": honour})
    decision = resolver.decide(context(client=client))
    assert (threshold_of(decision), decision.policy) == (value, policy)
    if policy == CLIENT:
        assert decision.reason == "client-supplied"


def test_the_resolver_forwards_latencies_and_usage() -> None:
    block = {"policy": {"type": "slo-feedback", "params": {"itl_p99": 0.05, "min_samples": 1}}}
    resolver = _threshold(block)
    assert isinstance(resolver.policy, SloFeedbackPolicy)
    resolver.decide(context(now=0.0))
    resolver.observe(LatencyObservation("m", "decode", 1.0, itl=1.0))
    assert resolver.decide(context(now=6.0)).reason == "itl-over-target"
    before = resolver.estimate_tokens("m", 3000)
    for _ in range(50):
        resolver.observe_usage("m", 3000, 1000)
    assert before == 750 and resolver.estimate_tokens("m", 3000) == pytest.approx(1000, abs=10)


def test_a_composite_spec_is_checked_at_build_not_load() -> None:
    config = ThresholdConfig.model_validate({"policy": {"type": "max", "params": {"x": 1}}})
    with pytest.raises(PolicyConfigError, match=r"params\.x: unknown field"):
        build_threshold(config, builtin_registry())
    with pytest.raises(ValidationError):
        ThresholdConfig.model_validate({"policy": {"type": "max", "extra": 1}})
