"""The threshold as the gateway uses it: built from configuration, decided per request.

:func:`build_threshold` turns the ``threshold:`` block into a
:class:`ThresholdResolver`, which the gateway asks for each request's threshold
(:meth:`~ThresholdResolver.decide`) and the route it then took
(:meth:`~ThresholdResolver.chosen`), tells the latencies it measured
(:meth:`~ThresholdResolver.observe`) and the prompt sizes upstream reported
(:meth:`~ThresholdResolver.observe_usage`). Decision order: the client's own
``cache_hit_threshold`` when present and ``honour_client`` is set (policy
``client``, reason ``client-supplied``); else the policy, through the per-pool and
per-model overrides when any are configured.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

from pd_orchestrator.config.policy import PromptLengthConfig, ThresholdConfig
from pd_orchestrator.model.load import Candidate
from pd_orchestrator.model.route import Route, at
from pd_orchestrator.policies.base import LatencyObservation, ThresholdContext, ThresholdPolicy
from pd_orchestrator.policies.build import PolicyConfigError, build_policy
from pd_orchestrator.policies.calibration import Probe, Timed
from pd_orchestrator.policies.estimator import PromptLengthEstimator
from pd_orchestrator.policies.goodput import GoodputPolicy
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
    ``ranks_spill``: the policy has the decode routing rank the prefillers whose pool
    spills beside the decoders
    (:attr:`~pd_orchestrator.policies.base.ThresholdPolicy.ranks_spill`).
    ``observes``: a policy learns from latencies
    (:attr:`~pd_orchestrator.policies.base.ThresholdPolicy.observes`); without one,
    :meth:`observe` need not be called.
    """

    policy: ThresholdPolicy
    honour_client: bool = True
    prompt_length: PromptLengthEstimator = field(default_factory=PromptLengthEstimator)
    exact_prompt_length: bool = False
    ranks_spill: bool = field(init=False, default=False)
    observes: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        self.ranks_spill = self.policy.ranks_spill
        self.observes = self.policy.observes

    def estimate_tokens(self, model: str, chars: int) -> int:
        """The prompt's tokens, estimated from its characters (see the estimator)."""
        return self.prompt_length.estimate(model, chars)

    def _client(self, context: ThresholdContext) -> float | None:
        """The client's own threshold when it decides (see the module docstring)."""
        return context.client_threshold if self.honour_client else None

    def decide(self, context: ThresholdContext) -> Route:
        """The route for one request (see the module docstring)."""
        client = self._client(context)
        if client is not None:
            return at(client, CLIENT, "client-supplied")
        return self.policy.decide(context)

    def chosen(self, context: ThresholdContext, route: Route) -> None:
        """The request decided for ``context`` takes ``route``: the policy learns it,
        unless the client's own threshold decided (the policy was not asked)."""
        if self._client(context) is None:
            self.policy.chosen(context, route)

    def observe(self, observation: LatencyObservation) -> None:
        """One finished request's latencies, for the policies that learn from them."""
        self.policy.observe(observation)

    def observe_usage(self, model: str, prompt_chars: int, prompt_tokens: int) -> None:
        """Upstream counted ``prompt_tokens`` for a prompt of ``prompt_chars`` characters."""
        self.prompt_length.observe(model, prompt_chars, prompt_tokens)

    def inherit(self, previous: ThresholdResolver) -> None:
        """Keep what the policies of ``previous`` (the configuration before a reload)
        learnt: each ``goodput`` policy takes the learnt state of the one of the same
        name, if any (its parameters stay the new configuration's)."""
        before = {p.name: p for p in _goodputs(previous.policy)}
        for policy in _goodputs(self.policy):
            old = before.get(policy.name)
            if old is not None:
                policy.model.inherit(old.model)

    def probes(self, candidates: Sequence[Candidate]) -> list[Probe]:
        """The cold prompts the ``goodput`` policies ask the gateway to time at start-up
        (:meth:`GoodputPolicy.probes`), one probe per endpoint (the first policy's)."""
        probes: dict[str, Probe] = {}
        for policy in _goodputs(self.policy):
            for probe in policy.probes(candidates):
                probes.setdefault(probe.endpoint.name, probe)
        return list(probes.values())

    def calibrate(self, probe: Probe, timed: Timed) -> None:
        """A probe prompt as the gateway timed it, for every ``goodput`` policy
        (:meth:`~pd_orchestrator.policies.goodput_model.GoodputModel.calibrate`)."""
        for policy in _goodputs(self.policy):
            policy.model.calibrate(probe, timed)

    def calibrated(self, endpoint: str) -> None:
        """The probe on ``endpoint`` has ended: every ``goodput`` policy forgets the hit
        rate it remembers there
        (:meth:`~pd_orchestrator.policies.goodput_model.GoodputModel.calibrated`)."""
        for policy in _goodputs(self.policy):
            policy.model.calibrated(endpoint)

    def learnt(self) -> dict[str, dict[str, dict[str, float | None]]]:
        """Per ``goodput`` policy (by name), what its cost model holds per pool
        (:meth:`~pd_orchestrator.policies.goodput_model.GoodputModel.learnt`)."""
        return {p.name: p.model.learnt() for p in _goodputs(self.policy)}

    def kept(self, now: float) -> dict[str, dict[str, float]]:
        """Per ``goodput`` policy (by name), the prefill tokens it kept per decoder as of
        ``now`` (:meth:`~pd_orchestrator.policies.goodput_model.GoodputModel.kept_now`;
        policies that kept none left out)."""
        kept = {p.name: p.model.kept_now(now) for p in _goodputs(self.policy)}
        return {name: tokens for name, tokens in kept.items() if tokens}

    def share_kept(self, kept: Mapping[str, Mapping[str, float]], now: float) -> None:
        """Tell each ``goodput`` policy what the other gateways' policies of its name
        kept per decoder (:meth:`kept`, summed over them; empty: each alone)."""
        for policy in _goodputs(self.policy):
            policy.model.share(kept.get(policy.name, {}), now)


def _goodputs(policy: ThresholdPolicy) -> list[GoodputPolicy]:
    """The ``goodput`` policies among ``policy`` and those it composes."""
    return [p for p in _tree(policy) if isinstance(p, GoodputPolicy)]


def _tree(policy: ThresholdPolicy) -> list[ThresholdPolicy]:
    """``policy`` and every policy it composes (children, override rules, default)."""
    found = [policy]
    for part in policy.parts:
        found += _tree(part)
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
