"""The threshold as the gateway uses it: built from configuration, decided per request.

:func:`build_threshold` turns the ``threshold:`` block into a
:class:`ThresholdResolver`, which the gateway asks for each request's threshold
(:meth:`~ThresholdResolver.decide`), tells the latencies it measured
(:meth:`~ThresholdResolver.observe`) and the prompt sizes upstream reported
(:meth:`~ThresholdResolver.observe_usage`). Decision order: the client's own
``cache_hit_threshold`` when present and ``honour_client`` is set (policy
``client``, reason ``client-supplied``); else the policy, through the per-pool and
per-model overrides when any are configured.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

from pd_orchestrator.config.policy import PromptLengthConfig, ThresholdConfig
from pd_orchestrator.policies.base import (
    LatencyObservation,
    ThresholdContext,
    ThresholdDecision,
    ThresholdPolicy,
)
from pd_orchestrator.policies.build import PolicyConfigError, build_policy
from pd_orchestrator.policies.estimator import PromptLengthEstimator
from pd_orchestrator.policies.overrides import build_overrides
from pd_orchestrator.routing.registry import Registry

__all__ = ["CLIENT", "ThresholdResolver", "build_estimator", "build_threshold"]

CLIENT = "client"
"""The ``policy`` label of decisions that take the client's threshold."""


@dataclass(slots=True)
class ThresholdResolver:
    """The configured policy, the client rule and the prompt-length estimator.

    ``exact_prompt_length``: the configuration asks the gateway to count prompt
    tokens exactly (``/tokenize``) rather than use :meth:`estimate_tokens`.
    ``reads_prefillers``: some policy of the tree reads the compatible prefillers
    (declared by a policy's ``reads_prefillers`` attribute); otherwise the planner
    leaves them out of the context and ranks no prefiller for an admitted request.
    ``reads_peers``: likewise for the chosen decoder's peers
    (:attr:`~pd_orchestrator.policies.base.ThresholdContext.peers`); ``reads_cache``:
    for the decoder's cached prefix of the prompt
    (:attr:`~pd_orchestrator.policies.base.ThresholdContext.cached_tokens`);
    ``reads_spill``: for a spilling prefiller as the context's decoder (the planner
    then ranks the spilling prefillers beside the decoders; see
    :attr:`~pd_orchestrator.policies.base.ThresholdContext.decoder`).
    """

    policy: ThresholdPolicy
    honour_client: bool = True
    prompt_length: PromptLengthEstimator = field(default_factory=PromptLengthEstimator)
    exact_prompt_length: bool = False
    reads_prefillers: bool = field(init=False, default=False)
    reads_peers: bool = field(init=False, default=False)
    reads_cache: bool = field(init=False, default=False)
    reads_spill: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        tree = _tree(self.policy)
        self.reads_prefillers = any(getattr(p, "reads_prefillers", False) for p in tree)
        self.reads_peers = any(getattr(p, "reads_peers", False) for p in tree)
        self.reads_cache = any(getattr(p, "reads_cache", False) for p in tree)
        self.reads_spill = any(getattr(p, "reads_spill", False) for p in tree)

    def estimate_tokens(self, model: str, chars: int) -> int:
        """The prompt's tokens, estimated from its characters (see the estimator)."""
        return self.prompt_length.estimate(model, chars)

    def decide(self, context: ThresholdContext) -> ThresholdDecision:
        """The threshold for one request (see the module docstring)."""
        client = context.client_threshold
        if self.honour_client and client is not None:
            return ThresholdDecision(client, CLIENT, "client-supplied")
        return self.policy.decide(context)

    def observe(self, observation: LatencyObservation) -> None:
        """One finished request's latencies, for the policies that learn from them."""
        self.policy.observe(observation)

    def observe_usage(self, model: str, prompt_chars: int, prompt_tokens: int) -> None:
        """Upstream counted ``prompt_tokens`` for a prompt of ``prompt_chars`` characters."""
        self.prompt_length.observe(model, prompt_chars, prompt_tokens)


def _tree(policy: ThresholdPolicy) -> list[ThresholdPolicy]:
    """``policy`` and every policy it composes (children, override rules, default)."""
    found = [policy]
    for child in getattr(policy, "children", ()):
        found += _tree(child)
    for rule in getattr(policy, "rules", ()):
        found += _tree(rule.policy)
    default = getattr(policy, "default", None)
    if default is not None:
        found += _tree(default)
    return found


def build_estimator(config: PromptLengthConfig) -> PromptLengthEstimator:
    """The estimator the ``prompt_length`` block describes."""
    return PromptLengthEstimator(
        chars_per_token=config.chars_per_token,
        calibrate=config.calibrate,
        min_chars_per_token=config.min_chars_per_token,
        max_chars_per_token=config.max_chars_per_token,
        window=config.window,
    )


def _check_pools(config: ThresholdConfig, pools: Collection[str]) -> None:
    for index, override in enumerate(config.overrides):
        if override.pool is not None and override.pool not in pools:
            known = ", ".join(sorted(pools)) or "none"
            problem = f"unknown pool {override.pool!r} (known: {known})"
            spec = override.policy
            raise PolicyConfigError(
                f"threshold.overrides[{index}]", spec.instance_name, problem, spec.type
            )


def build_threshold(
    config: ThresholdConfig, registry: Registry, *, pools: Collection[str] | None = None
) -> ThresholdResolver:
    """The resolver ``config`` describes, its policies built through ``registry``.

    With ``pools`` (the configured pool names), an override naming another pool is
    an error. Raises :class:`PolicyConfigError` naming the location and the policy.
    """
    if pools is not None:
        _check_pools(config, pools)
    policy: ThresholdPolicy
    if config.overrides:
        where = ("threshold.policy", "threshold.overrides")
        policy = build_overrides(registry, config.policy, config.overrides, where)
    else:
        policy = build_policy(registry, config.policy, "threshold.policy")
    return ThresholdResolver(
        policy=policy,
        honour_client=config.honour_client,
        prompt_length=build_estimator(config.prompt_length),
        exact_prompt_length=config.prompt_length.exact,
    )
