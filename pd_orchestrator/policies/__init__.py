"""Threshold policies: pure functions from a request and the fleet to a threshold."""

from pd_orchestrator.policies.base import (
    StaticPolicy,
    ThresholdContext,
    ThresholdDecision,
    ThresholdPolicy,
    build_policy,
    resolve_threshold,
)

__all__ = [
    "StaticPolicy",
    "ThresholdContext",
    "ThresholdDecision",
    "ThresholdPolicy",
    "build_policy",
    "resolve_threshold",
]
