"""``static``: the same threshold for every request.

Parameters (:class:`StaticParams`): ``value`` in [0, 1], default 0.7.
Reason: ``fixed``. Bounds: ``(value, value)``.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from pd_orchestrator.model.records import record
from pd_orchestrator.model.route import Route, at
from pd_orchestrator.policies.base import (
    POLICY,
    Leaf,
    ThresholdContext,
)
from pd_orchestrator.routing.interfaces import PluginContext
from pd_orchestrator.routing.registry import NoParams, PluginType

__all__ = ["STATIC", "StaticParams", "StaticPolicy"]


class StaticParams(NoParams):
    """``value`` (in [0, 1], default 0.7): the threshold."""

    value: Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)] = 0.7


@record
class StaticPolicy(Leaf):
    """The same threshold for every request."""

    value: float
    name: str = "static"

    @property
    def bounds(self) -> tuple[float, float]:
        return (self.value, self.value)

    def decide(self, context: ThresholdContext) -> Route:
        return at(self.value, self.name, "fixed")


def _static(params: StaticParams, context: PluginContext) -> StaticPolicy:
    return StaticPolicy(params.value, context.name)


STATIC = PluginType("static", POLICY, StaticParams, _static)
