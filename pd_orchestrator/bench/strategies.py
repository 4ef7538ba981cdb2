"""What a benchmark compares: serving strategies, each a mode and (for decode-first)
a threshold policy.

* ``always-pd`` -- prefill-first for every request (what vllm-router and llm-d's
  NIXL path do): prefill on a prefiller, KV to the decoder, decode there.
* ``decode-only`` -- every instance decodes, threshold 0, no prefillers
  (aggregated serving on the same instances).
* ``dynamo`` -- decode-first with :class:`MinUncachedTokensRule` (2048): Dynamo's
  conditional disaggregation (remote prefill unless the uncached part is short)
  expressed as a threshold.
* ``static-<v>`` -- decode-first with a fixed threshold ``v`` (a sweep).
* any name bound in a policy file (:func:`load_policy_file`): decode-first with a
  policy built from a ``threshold.policy`` block by the project's own
  :func:`~pd_orchestrator.policies.build_policy`, so every policy the gateway can
  run drops in without code here.

Strategies only describe; the virtual fleet and the live runner carry them out.
Policies are used through the :class:`~pd_orchestrator.policies.ThresholdPolicy`
protocol and :func:`~pd_orchestrator.policies.resolve_threshold`, with the context
built by :func:`threshold_context` (the one place that knows its fields).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import yaml
from pydantic import ValidationError

from pd_orchestrator.config.settings import ThresholdConfig
from pd_orchestrator.fleet.state import EndpointStatus
from pd_orchestrator.policies import (
    StaticPolicy,
    ThresholdContext,
    ThresholdDecision,
    ThresholdPolicy,
    build_policy,
    resolve_threshold,
)

__all__ = [
    "CHARS_PER_TOKEN",
    "DEFAULT_STRATEGIES",
    "MinUncachedTokensRule",
    "Mode",
    "Strategy",
    "decide_threshold",
    "load_policy_file",
    "resolve_strategies",
    "threshold_context",
]

CHARS_PER_TOKEN = 4
"""The gateway's character count of a token-id prompt is 4 per token."""

DEFAULT_STRATEGIES = (
    "always-pd",
    "decode-only",
    "dynamo",
    "static-0.3",
    "static-0.5",
    "static-0.7",
    "static-0.9",
)


class Mode(enum.StrEnum):
    """How requests are served."""

    DECODE_FIRST = "decode-first"
    PREFILL_FIRST = "prefill-first"
    DECODE_ONLY = "decode-only"


@dataclass(frozen=True, slots=True)
class Strategy:
    """A named mode; decode-first strategies carry their threshold policy."""

    name: str
    mode: Mode
    policy: ThresholdPolicy | None = None
    description: str = ""

    def __post_init__(self) -> None:
        if (self.mode is Mode.DECODE_FIRST) != (self.policy is not None):
            raise ValueError(f"strategy {self.name!r}: decode-first, and only it, needs a policy")

    @property
    def static_threshold(self) -> float | None:
        """The fixed threshold of a static policy (what a gateway config can carry)."""
        if self.mode is Mode.DECODE_ONLY:
            return 0.0
        return self.policy.value if isinstance(self.policy, StaticPolicy) else None


@dataclass(frozen=True, slots=True)
class MinUncachedTokensRule:
    """Remote prefill only when more than ``limit`` prompt tokens are uncached.

    As a threshold: ``max(0, 1 - limit / tokens)``, so a decoder admits a request
    whose uncached part is at most ``limit`` tokens. Tokens are estimated from the
    context's character count at ``chars_per_token`` (exact for token-id prompts).
    """

    limit: int = 2048
    chars_per_token: float = CHARS_PER_TOKEN
    name: str = "min-uncached-tokens"

    def decide(self, context: ThresholdContext) -> ThresholdDecision:
        tokens = max(1.0, context.prompt_chars / self.chars_per_token)
        value = max(0.0, 1.0 - self.limit / tokens)
        return ThresholdDecision(value, self.name, f"at most {self.limit} uncached tokens")


def threshold_context(
    *, model: str, prompt_tokens: int, decoder: EndpointStatus, now: float
) -> ThresholdContext:
    """The context a gateway builds for a token-id prompt of ``prompt_tokens`` tokens."""
    return ThresholdContext(
        model=model,
        prompt_chars=CHARS_PER_TOKEN * prompt_tokens,
        decoder=decoder,
        client_threshold=None,
        now=now,
    )


def decide_threshold(policy: ThresholdPolicy, context: ThresholdContext) -> ThresholdDecision:
    """The threshold for one request, exactly as the gateway resolves it."""
    return resolve_threshold(policy, ThresholdConfig(), context)


def load_policy_file(path: Path) -> dict[str, ThresholdPolicy]:
    """Named policies from YAML: ``{name: <threshold.policy block>}``.

    Each block is validated as the gateway's ``threshold.policy`` and built by
    :func:`~pd_orchestrator.policies.build_policy`; errors name the entry.
    """
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of policy names to policy blocks")
    policies: dict[str, ThresholdPolicy] = {}
    for name, block in data.items():
        try:
            config = ThresholdConfig.model_validate({"policy": block})
        except ValidationError as exc:
            raise ValueError(f"{path}: policy {name!r}: {exc}") from None
        policies[str(name)] = build_policy(config.policy)
    return policies


def _static(name: str) -> Strategy:
    try:
        value = float(name.removeprefix("static-"))
    except ValueError:
        raise ValueError(f"{name!r}: static strategies are named static-<threshold>") from None
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name!r}: the threshold must be within [0, 1]")
    return Strategy(
        name, Mode.DECODE_FIRST, StaticPolicy(value), f"decode-first, threshold {value:g}"
    )


def _builtin(name: str) -> Strategy | None:
    if name == "always-pd":
        return Strategy(name, Mode.PREFILL_FIRST, description="prefill-first for every request")
    if name == "decode-only":
        return Strategy(name, Mode.DECODE_ONLY, description="all instances decode, threshold 0")
    if name == "dynamo":
        rule = MinUncachedTokensRule()
        return Strategy(name, Mode.DECODE_FIRST, rule, "decode-first, <= 2048 uncached tokens")
    if name.startswith("static-"):
        return _static(name)
    return None


def resolve_strategies(
    names: Iterable[str], policies: Mapping[str, ThresholdPolicy] | None = None
) -> list[Strategy]:
    """Strategies for ``names``: built-ins (module docstring) and ``policies`` by name."""
    policies = policies or {}
    strategies: list[Strategy] = []
    for name in names:
        if name in policies:
            policy = policies[name]
            strategies.append(
                Strategy(name, Mode.DECODE_FIRST, policy, f"decode-first, {policy.name}")
            )
            continue
        strategy = _builtin(name)
        if strategy is None:
            known = ", ".join([*DEFAULT_STRATEGIES, "static-<v>", *policies])
            raise ValueError(f"unknown strategy {name!r} (known: {known})")
        strategies.append(strategy)
    duplicates = sorted(
        {s.name for s in strategies if [t.name for t in strategies].count(s.name) > 1}
    )
    if duplicates:
        raise ValueError(f"strategies named twice: {', '.join(duplicates)}")
    return strategies
