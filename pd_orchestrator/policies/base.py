"""The threshold policy interface and the static policy.

A policy sees a :class:`ThresholdContext` (the request's size, the chosen
decoder's status, the clock) and returns a :class:`ThresholdDecision`: the
threshold, which policy chose it and why. :func:`resolve_threshold` applies the
client's own ``cache_hit_threshold`` first when the configuration honours it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from pd_orchestrator.config.settings import StaticPolicyConfig, ThresholdConfig
from pd_orchestrator.fleet.state import EndpointStatus

__all__ = [
    "StaticPolicy",
    "ThresholdContext",
    "ThresholdDecision",
    "ThresholdPolicy",
    "build_policy",
    "resolve_threshold",
]


@dataclass(frozen=True, slots=True)
class ThresholdContext:
    """What a policy may look at for one request."""

    model: str
    prompt_chars: int
    decoder: EndpointStatus
    client_threshold: float | None
    now: float


@dataclass(frozen=True, slots=True)
class ThresholdDecision:
    """A threshold in [0, 1], the policy that set it and a short reason."""

    value: float
    policy: str
    reason: str


class ThresholdPolicy(Protocol):
    @property
    def name(self) -> str:
        """The policy's name, as counted in metrics."""
        ...

    def decide(self, context: ThresholdContext) -> ThresholdDecision:
        """The threshold for one request (pure)."""
        ...


@dataclass(frozen=True, slots=True)
class StaticPolicy:
    """The same threshold for every request."""

    value: float
    name: str = "static"

    def decide(self, context: ThresholdContext) -> ThresholdDecision:
        return ThresholdDecision(self.value, self.name, "fixed")


def build_policy(config: StaticPolicyConfig) -> ThresholdPolicy:
    """The policy a configuration block describes."""
    return StaticPolicy(config.value)


def resolve_threshold(
    policy: ThresholdPolicy, config: ThresholdConfig, context: ThresholdContext
) -> ThresholdDecision:
    """The client's threshold when present and honoured, else the policy's."""
    if config.honour_client and context.client_threshold is not None:
        return ThresholdDecision(context.client_threshold, "client", "client-supplied")
    return policy.decide(context)
