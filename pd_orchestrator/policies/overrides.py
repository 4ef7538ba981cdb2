"""Per-pool and per-model overrides: a different policy for some requests.

A rule names a ``pool`` (of the chosen decoder), a ``model``, or both. For each
request the most specific matching rule decides: pool and model, then pool
alone, then model alone, else the default policy; the first rule listed wins a
tie (the configuration refuses two rules with the same selector). A latency
observation goes to the one policy its pool and model select, so a per-pool
``slo-feedback`` learns only from its own pool. The decision is the selected
policy's own. Bounds: the lowest low and the highest high of all the policies.

The ``threshold.overrides`` list of the configuration builds this layer; it is
also the ``overrides`` policy type (:class:`OverridesParams`: ``default``, a spec,
and ``rules``, a list of ``{pool, model, policy}``), so it can nest in a composite.
"""

from __future__ import annotations

from typing import Self

from pydantic import Field, model_validator

from pd_orchestrator.config.policy import OverrideSpec, PolicySpec, duplicate_selectors
from pd_orchestrator.model.records import record
from pd_orchestrator.model.route import Route
from pd_orchestrator.policies.base import (
    POLICY,
    LatencyObservation,
    ThresholdContext,
    ThresholdPolicy,
)
from pd_orchestrator.policies.build import build_policy
from pd_orchestrator.routing.interfaces import PluginContext
from pd_orchestrator.routing.registry import NoParams, PluginType, Registry

__all__ = [
    "OverrideRule",
    "OverridesParams",
    "OverridesPolicy",
    "build_overrides",
    "overrides_type",
]


@record
class OverrideRule:
    """A policy for a pool, a model, or both (None: any)."""

    policy: ThresholdPolicy
    pool: str | None = None
    model: str | None = None

    def specificity(self, pool: str, model: str) -> int:
        """3: pool and model match, 2: pool, 1: model, 0: no match."""
        if self.pool is not None and self.pool != pool:
            return 0
        if self.model is not None and self.model != model:
            return 0
        return (2 if self.pool is not None else 0) + (1 if self.model is not None else 0)


@record
class OverridesPolicy:
    """The default policy and the rules that override it; see the module docstring."""

    default: ThresholdPolicy
    rules: tuple[OverrideRule, ...] = ()
    name: str = "overrides"

    def select(self, pool: str, model: str) -> ThresholdPolicy:
        """The policy for requests decoded in ``pool`` for ``model``."""
        best, best_rank = self.default, 0
        for rule in self.rules:
            rank = rule.specificity(pool, model)
            if rank > best_rank:
                best, best_rank = rule.policy, rank
        return best

    @property
    def bounds(self) -> tuple[float, float]:
        every = [self.default.bounds, *(rule.policy.bounds for rule in self.rules)]
        return (min(low for low, _ in every), max(high for _, high in every))

    @property
    def parts(self) -> tuple[ThresholdPolicy, ...]:
        return (self.default, *(rule.policy for rule in self.rules))

    @property
    def ranks_spill(self) -> bool:
        return any(part.ranks_spill for part in self.parts)

    @property
    def observes(self) -> bool:
        return any(part.observes for part in self.parts)

    def decide(self, context: ThresholdContext) -> Route:
        return self.select(context.pool, context.model).decide(context)

    def chosen(self, context: ThresholdContext, route: Route) -> None:
        self.select(context.pool, context.model).chosen(context, route)

    def observe(self, observation: LatencyObservation) -> None:
        self.select(observation.pool, observation.model).observe(observation)


class OverridesParams(NoParams):
    """``default``: the policy without a matching rule (default: static 0.7).
    ``rules``: ``{pool, model, policy}`` entries (at least one of pool and model)."""

    default: PolicySpec = Field(default_factory=lambda: PolicySpec(value=0.7))
    rules: list[OverrideSpec] = Field(default_factory=list)

    @model_validator(mode="after")
    def _distinct(self) -> Self:
        duplicates = duplicate_selectors(self.rules)
        if duplicates:
            raise ValueError(f"more than one rule for {'; '.join(duplicates)}")
        return self


def build_overrides(
    registry: Registry,
    default: PolicySpec,
    rules: list[OverrideSpec],
    where: tuple[str, str],
    name: str = "overrides",
) -> OverridesPolicy:
    """The layer for ``default`` and ``rules``; ``where`` locates the default spec and
    the rules list in the configuration (for error messages)."""
    default_at, rules_at = where
    built = tuple(
        OverrideRule(
            build_policy(registry, rule.policy, f"{rules_at}[{index}].policy"),
            rule.pool,
            rule.model,
        )
        for index, rule in enumerate(rules)
    )
    return OverridesPolicy(build_policy(registry, default, default_at), built, name)


def overrides_type(registry: Registry) -> PluginType[OverridesParams, ThresholdPolicy]:
    """The ``overrides`` policy type, building its policies through ``registry``."""

    def factory(params: OverridesParams, context: PluginContext) -> OverridesPolicy:
        where = (f"{context.profile}.params.default", f"{context.profile}.params.rules")
        return build_overrides(registry, params.default, params.rules, where, context.name)

    return PluginType("overrides", POLICY, OverridesParams, factory)
