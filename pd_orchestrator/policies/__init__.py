"""Threshold policies (pure): from a request and the fleet's load to a cache-hit threshold.

Typical use by the gateway::

    threshold = build_threshold(config.threshold, builtin_registry(), pools=pool_names)
    tokens = threshold.estimate_tokens(model, prompt_chars)
    route = threshold.decide(ThresholdContext(model, decoder, tokens, prompt_chars,
                                              client_threshold, now, reads))
    threshold.chosen(context, final_route)
    ...
    threshold.observe(LatencyObservation(model, pool, now, ttft=..., itl=...))
    threshold.observe_usage(model, prompt_chars, usage.prompt_tokens)

Built-in policy types (each module states its law): ``static``,
``min-uncached-tokens``, ``load-adaptive``, ``slo-feedback``, ``max``, ``min``,
``weighted``, ``overrides``.
"""

from pd_orchestrator.policies.base import (
    POLICY,
    LatencyObservation,
    ThresholdContext,
    ThresholdPolicy,
)
from pd_orchestrator.policies.build import PolicyConfigError, build_policy
from pd_orchestrator.policies.compose import ExtremePolicy, WeightedPolicy
from pd_orchestrator.policies.estimator import PromptLengthEstimator
from pd_orchestrator.policies.load_adaptive import LoadAdaptiveParams, LoadAdaptivePolicy
from pd_orchestrator.policies.min_uncached import MinUncachedTokensPolicy
from pd_orchestrator.policies.overrides import OverrideRule, OverridesPolicy
from pd_orchestrator.policies.plugins import LEAF_POLICY_TYPES, register_policies
from pd_orchestrator.policies.slo_feedback import SloFeedbackParams, SloFeedbackPolicy
from pd_orchestrator.policies.static import StaticPolicy
from pd_orchestrator.policies.threshold import (
    CLIENT,
    ThresholdResolver,
    build_estimator,
    build_threshold,
)

__all__ = [
    "CLIENT",
    "LEAF_POLICY_TYPES",
    "POLICY",
    "ExtremePolicy",
    "LatencyObservation",
    "LoadAdaptiveParams",
    "LoadAdaptivePolicy",
    "MinUncachedTokensPolicy",
    "OverrideRule",
    "OverridesPolicy",
    "PolicyConfigError",
    "PromptLengthEstimator",
    "SloFeedbackParams",
    "SloFeedbackPolicy",
    "StaticPolicy",
    "ThresholdContext",
    "ThresholdPolicy",
    "ThresholdResolver",
    "WeightedPolicy",
    "build_estimator",
    "build_policy",
    "build_threshold",
    "register_policies",
]
