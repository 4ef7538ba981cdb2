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
from typing import Any

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
    "ConfiguredPolicy",
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
    """A named mode; decode-first strategies carry their threshold policy.

    ``config_block``: the gateway's ``threshold.policy`` block that runs the same
    policy, when there is one (live runs need it).
    """

    name: str
    mode: Mode
    policy: ThresholdPolicy | None = None
    description: str = ""
    config_block: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        if (self.mode is Mode.DECODE_FIRST) != (self.policy is not None):
            raise ValueError(f"strategy {self.name!r}: decode-first, and only it, needs a policy")


@dataclass(frozen=True, slots=True)
class ConfiguredPolicy:
    """A policy built from a gateway ``threshold.policy`` block, and the block."""

    policy: ThresholdPolicy
    block: Mapping[str, Any]


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


def load_policy_file(path: Path) -> dict[str, ConfiguredPolicy]:
    """Named policies from YAML: ``{name: <threshold.policy block>}``.

    Each block is validated as the gateway's ``threshold.policy`` and built by
    :func:`~pd_orchestrator.policies.build_policy`; errors name the entry.
    """
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of policy names to policy blocks")
    policies: dict[str, ConfiguredPolicy] = {}
    for name, block in data.items():
        try:
            config = ThresholdConfig.model_validate({"policy": block})
        except ValidationError as exc:
            raise ValueError(f"{path}: policy {name!r}: {exc}") from None
        policies[str(name)] = ConfiguredPolicy(build_policy(config.policy), dict(block))
    return policies


def _static(name: str) -> Strategy:
    try:
        value = float(name.removeprefix("static-"))
    except ValueError:
        raise ValueError(f"{name!r}: static strategies are named static-<threshold>") from None
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name!r}: the threshold must be within [0, 1]")
    block = {"type": "static", "value": value}
    return Strategy(
        name, Mode.DECODE_FIRST, StaticPolicy(value), f"decode-first, threshold {value:g}", block
    )


def _fixed() -> dict[str, Strategy]:
    """The built-in strategies with fixed names."""
    return {
        "always-pd": Strategy(
            "always-pd", Mode.PREFILL_FIRST, None, "prefill-first for every request"
        ),
        "decode-only": Strategy(
            "decode-only",
            Mode.DECODE_ONLY,
            None,
            "all instances decode, threshold 0",
            {"type": "static", "value": 0.0},
        ),
        "dynamo": Strategy(
            "dynamo",
            Mode.DECODE_FIRST,
            MinUncachedTokensRule(),
            "decode-first, at most 2048 uncached tokens",
        ),
    }


def resolve_strategies(
    names: Iterable[str], policies: Mapping[str, ConfiguredPolicy] | None = None
) -> list[Strategy]:
    """Strategies for ``names``: built-ins (module docstring) and ``policies`` by name."""
    policies = policies or {}
    fixed = _fixed()
    strategies: list[Strategy] = []
    for name in names:
        if name in policies:
            configured = policies[name]
            description = f"decode-first, {configured.policy.name}"
            strategies.append(
                Strategy(name, Mode.DECODE_FIRST, configured.policy, description, configured.block)
            )
        elif name in fixed:
            strategies.append(fixed[name])
        elif name.startswith("static-"):
            strategies.append(_static(name))
        else:
            known = ", ".join([*DEFAULT_STRATEGIES, "static-<v>", *policies])
            raise ValueError(f"unknown strategy {name!r} (known: {known})")
    names_seen = [s.name for s in strategies]
    duplicates = sorted({n for n in names_seen if names_seen.count(n) > 1})
    if duplicates:
        raise ValueError(f"strategies named twice: {', '.join(duplicates)}")
    return strategies
