"""Composite policies: ``max``, ``min`` and ``weighted`` of child policies.

Every child decides on every request (stateful children see the same sequence as
if they stood alone), is told the final route of each (:meth:`chosen`: a child that
learns from its choices learns what was kept, not what it proposed) and observes
every latency. Children answer :data:`~pd_orchestrator.model.route.Route` values;
a composite orders and averages them by the threshold each sends
(:func:`~pd_orchestrator.model.route.threshold_of`): :class:`Local` and
:class:`Whole` send 0, :class:`GoPD` and :class:`Decline` send 1.

- ``max`` / ``min`` (:class:`ComposeParams`: ``policies``, one or more specs): the
  child route with the largest / smallest threshold, whole (its policy name and
  reason, and the peer or prefiller it names), the first child winning ties: no
  route is made up. ``max`` of ``min-uncached-tokens`` and ``load-adaptive``
  prefills locally only when both agree it is cheap; ``min`` when either does.
  Bounds: the max / min of the children's lows and highs.
- ``weighted`` (:class:`WeightedParams`: ``policies`` and as many ``weights`` >= 0,
  with a positive sum): ``sum(w_i * v_i) / sum(w_i)`` of the children's thresholds,
  reason ``weighted``, under the composite's name: :func:`~pd_orchestrator.model.route.at`
  that mean (an :class:`Ask`, or :class:`Local` at 0, :class:`GoPD` at 1). A peer or a
  spilling prefiller a child names is dropped: a :class:`Whole` counts as 0 and, at a
  spilling prefiller the routing picked, a weighted 0 serves the request whole there
  (:class:`Local`), any other declines it. Bounds: the same weighted mean of the
  children's bounds.

Children are built through the registry the composite was built with, so any
registered policy type (composites included) may be a child.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Self

from pydantic import Field, model_validator

from pd_orchestrator.config.policy import PolicySpec
from pd_orchestrator.model.records import record
from pd_orchestrator.model.route import Route, at, threshold_of
from pd_orchestrator.policies.base import (
    POLICY,
    LatencyObservation,
    ThresholdContext,
    ThresholdPolicy,
    clamp_ratio,
)
from pd_orchestrator.policies.build import build_policy
from pd_orchestrator.routing.interfaces import PluginContext
from pd_orchestrator.routing.registry import NoParams, PluginType, Registry

__all__ = [
    "ComposeParams",
    "ExtremePolicy",
    "WeightedParams",
    "WeightedPolicy",
    "composite_types",
]


class ComposeParams(NoParams):
    """``policies``: the child policies (at least one)."""

    policies: Annotated[list[PolicySpec], Field(min_length=1)]


class WeightedParams(ComposeParams):
    """``policies`` and their ``weights`` (as many, each >= 0, positive sum)."""

    weights: list[Annotated[float, Field(ge=0.0, allow_inf_nan=False)]]

    @model_validator(mode="after")
    def _one_weight_each(self) -> Self:
        if len(self.weights) != len(self.policies):
            raise ValueError(
                f"{len(self.policies)} policies need as many weights, got {len(self.weights)}"
            )
        if sum(self.weights) <= 0.0:
            raise ValueError("the weights must not all be 0")
        return self


class _Composite:
    """What every composite does with its children: its parts are the children, it
    ranks spilling prefillers, and observes latencies, when one of them does; it tells
    every child the final route and lets every child observe each latency."""

    __slots__ = ()
    children: tuple[ThresholdPolicy, ...]

    @property
    def parts(self) -> tuple[ThresholdPolicy, ...]:
        return self.children

    @property
    def ranks_spill(self) -> bool:
        return any(child.ranks_spill for child in self.children)

    @property
    def observes(self) -> bool:
        return any(child.observes for child in self.children)

    def chosen(self, context: ThresholdContext, route: Route) -> None:
        for child in self.children:
            child.chosen(context, route)

    def observe(self, observation: LatencyObservation) -> None:
        for child in self.children:
            child.observe(observation)


@record
class ExtremePolicy(_Composite):
    """``max`` (``largest``) or ``min`` of the children; see the module docstring."""

    children: tuple[ThresholdPolicy, ...]
    largest: bool
    name: str

    @property
    def bounds(self) -> tuple[float, float]:
        pick = max if self.largest else min
        lows, highs = zip(*(child.bounds for child in self.children), strict=True)
        return (pick(lows), pick(highs))

    def decide(self, context: ThresholdContext) -> Route:
        routes = [child.decide(context) for child in self.children]
        best, value = routes[0], threshold_of(routes[0])
        for route in routes[1:]:
            other = threshold_of(route)
            if other > value if self.largest else other < value:
                best, value = route, other
        return best


@record
class WeightedPolicy(_Composite):
    """The weighted mean of the children; see the module docstring."""

    children: tuple[ThresholdPolicy, ...]
    weights: tuple[float, ...]
    name: str = "weighted"

    def _mean(self, values: Sequence[float]) -> float:
        total = sum(self.weights)
        return clamp_ratio(sum(w * v for w, v in zip(self.weights, values, strict=True)) / total)

    @property
    def bounds(self) -> tuple[float, float]:
        bounds = [child.bounds for child in self.children]
        return (self._mean([low for low, _ in bounds]), self._mean([high for _, high in bounds]))

    def decide(self, context: ThresholdContext) -> Route:
        values = [threshold_of(child.decide(context)) for child in self.children]
        return at(self._mean(values), self.name, "weighted")


def _children(
    registry: Registry, specs: Sequence[PolicySpec], context: PluginContext
) -> tuple[ThresholdPolicy, ...]:
    return tuple(
        build_policy(registry, spec, f"{context.profile}.params.policies[{index}]")
        for index, spec in enumerate(specs)
    )


def composite_types(registry: Registry) -> tuple[PluginType[Any, Any], ...]:
    """``max``, ``min`` and ``weighted``, building their children through ``registry``."""

    def largest(params: ComposeParams, context: PluginContext) -> ExtremePolicy:
        return ExtremePolicy(_children(registry, params.policies, context), True, context.name)

    def smallest(params: ComposeParams, context: PluginContext) -> ExtremePolicy:
        return ExtremePolicy(_children(registry, params.policies, context), False, context.name)

    def weighted(params: WeightedParams, context: PluginContext) -> WeightedPolicy:
        children = _children(registry, params.policies, context)
        return WeightedPolicy(children, tuple(params.weights), context.name)

    return (
        PluginType("max", POLICY, ComposeParams, largest),
        PluginType("min", POLICY, ComposeParams, smallest),
        PluginType("weighted", POLICY, WeightedParams, weighted),
    )
