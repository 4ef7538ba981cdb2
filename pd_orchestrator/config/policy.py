"""The ``threshold:`` configuration block: which policy sets the cache-hit threshold.

This module checks the shape only; each policy's ``params`` are validated by the
policy type's own strict model when the block is built through a registry
(:func:`pd_orchestrator.policies.build_threshold`). The YAML::

    threshold:
      policy:                        # the default policy (default: static 0.7)
        type: load-adaptive          # a registered policy type
        name: adaptive               # optional; the label in metrics (default: the type)
        params: {base: 0.7, floor: 0.3, ceiling: 0.95}
      overrides:                     # optional; the most specific match wins
        - {pool: h200-decode, policy: {type: min-uncached-tokens}}
        - {model: meta-llama/Llama-3.1-70B-Instruct, policy: {type: static, value: 0.9}}
        - pool: mi325x-decode
          model: meta-llama/Llama-3.1-8B-Instruct
          policy:
            type: max
            params:
              policies:
                - {type: min-uncached-tokens, params: {max_uncached_tokens: 1024}}
                - {type: slo-feedback, params: {ttft_p90: 0.5, itl_p99: 0.05}}
      honour_client: true            # a client's cache_hit_threshold wins when present
      prompt_length:                 # prompt tokens estimated from characters
        chars_per_token: 4.0
        calibrate: true              # learn the ratio per model from upstream usage
        exact: false                 # true: the gateway asks /tokenize instead

The older shape ``policy: {type: static, value: 0.7}`` still reads: ``value`` is
the shorthand of the static policy's ``params.value`` (and ``type`` defaults to
``static``), so ``PDO_THRESHOLD__POLICY__VALUE=0.8`` keeps working.

The default stays ``static 0.7``, not ``goodput``: ``goodput`` serves SLO targets
(``ttft``, ``tpot``) that only the operator can state, and on hardware the
simulator's table lacks it starts from seeds rather than measurements (the gateway
says which per pool: :func:`pd_orchestrator.gateway.state.goodput_knowledge`).
"""

from __future__ import annotations

from typing import Annotated, Self

from pydantic import BaseModel, ConfigDict, Field, JsonValue, model_validator

from pd_orchestrator.config.routing import PluginName, PluginSpec

__all__ = [
    "OverrideSpec",
    "PolicySpec",
    "PromptLengthConfig",
    "ThresholdConfig",
]

Ratio = Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PolicySpec(_Strict):
    """One policy instance: ``type`` (default ``static``), an optional ``name`` (the
    ``policy`` label of its decisions; default the type), ``params`` (validated by
    the type's model) and ``value``, the legacy shorthand of a static policy's
    ``params.value``."""

    type: PluginName = "static"
    name: PluginName | None = None
    params: dict[str, JsonValue] = Field(
        default_factory=dict, description="validated by the policy type's own model"
    )
    value: Ratio | None = Field(
        default=None, description="legacy shorthand for params.value of a static policy"
    )

    @model_validator(mode="after")
    def _shorthand_only_for_static(self) -> Self:
        if self.value is None:
            return self
        if self.type != "static":
            raise ValueError(
                f"`value` is the static policy's shorthand; a {self.type!r} policy takes `params`"
            )
        if "value" in self.params:
            raise ValueError("give the static value once: `value` or `params.value`")
        return self

    @property
    def instance_name(self) -> str:
        """The name, or the type when no name is given."""
        return self.name or self.type

    def plugin_spec(self) -> PluginSpec:
        """The registry's view of this spec (the shorthand moved into ``params``)."""
        params: dict[str, JsonValue] = dict(self.params)
        if self.value is not None:
            params["value"] = self.value
        return PluginSpec(type=self.type, name=self.name, params=params)


class OverrideSpec(_Strict):
    """A policy for requests whose chosen decoder is in ``pool`` and/or whose model
    is ``model`` (at least one of the two)."""

    pool: str | None = None
    model: str | None = None
    policy: PolicySpec

    @model_validator(mode="after")
    def _selects_something(self) -> Self:
        if self.pool is None and self.model is None:
            raise ValueError("an override needs a `pool`, a `model` or both")
        return self

    @property
    def selector(self) -> tuple[str | None, str | None]:
        return (self.pool, self.model)

    def describe(self) -> str:
        """``pool 'a', model 'm'`` (for messages)."""
        parts = [f"pool {self.pool!r}" if self.pool is not None else ""]
        parts.append(f"model {self.model!r}" if self.model is not None else "")
        return ", ".join(part for part in parts if part)


def duplicate_selectors(overrides: list[OverrideSpec]) -> list[str]:
    """Selectors used by more than one override, described, in order of first use."""
    seen: dict[tuple[str | None, str | None], int] = {}
    for override in overrides:
        seen[override.selector] = seen.get(override.selector, 0) + 1
    described = {o.selector: o.describe() for o in overrides}
    return [described[selector] for selector, count in seen.items() if count > 1]


class PromptLengthConfig(_Strict):
    """How the gateway knows a prompt's length in tokens without tokenizing it.

    ``chars_per_token`` (> 0, default 4.0): the prior ratio. ``calibrate`` (default
    true): learn the ratio per model from the ``prompt_tokens`` upstream usage
    reports. ``min_chars_per_token`` / ``max_chars_per_token`` (defaults 1 and 16):
    the bounds a learnt ratio (and each observation) is clipped to. ``window``
    (>= 1, default 200): about how many recent observations the learnt ratio
    reflects. ``exact`` (default false): the gateway asks the decoder's
    ``/tokenize`` for the exact count instead of estimating.
    """

    chars_per_token: Annotated[float, Field(gt=0.0, allow_inf_nan=False)] = 4.0
    calibrate: bool = True
    exact: bool = False
    min_chars_per_token: Annotated[float, Field(gt=0.0, allow_inf_nan=False)] = 1.0
    max_chars_per_token: Annotated[float, Field(gt=0.0, allow_inf_nan=False)] = 16.0
    window: Annotated[int, Field(ge=1)] = 200

    @model_validator(mode="after")
    def _ordered_bounds(self) -> Self:
        low, high = self.min_chars_per_token, self.max_chars_per_token
        if not low <= self.chars_per_token <= high:
            raise ValueError(
                f"chars_per_token {self.chars_per_token} is outside "
                f"[min_chars_per_token {low}, max_chars_per_token {high}]"
            )
        return self


class ThresholdConfig(_Strict):
    """The cache-hit threshold sent on decode attempts (see the module docstring)."""

    policy: PolicySpec = Field(default_factory=lambda: PolicySpec(value=0.7))
    overrides: list[OverrideSpec] = Field(default_factory=list)
    honour_client: bool = Field(
        default=True,
        description="use a client-supplied cache_hit_threshold instead of the policy's",
    )
    prompt_length: PromptLengthConfig = Field(default_factory=PromptLengthConfig)

    @model_validator(mode="after")
    def _distinct_overrides(self) -> Self:
        duplicates = duplicate_selectors(self.overrides)
        if duplicates:
            raise ValueError(f"more than one override for {'; '.join(duplicates)}")
        return self
