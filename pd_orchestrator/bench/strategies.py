"""What a benchmark compares: serving strategies, each a mode and (for decode-first)
a threshold policy.

* ``always-pd`` -- prefill-first for every request (what vllm-router and llm-d's
  NIXL path do): prefill on a prefiller, KV to the decoder, decode there; the
  prefiller picked as vllm-router's P/D mode picks it (``cache_aware``).
* ``decode-only`` -- every instance decodes, threshold 0, no prefillers
  (aggregated serving on the same instances).
* ``dynamo`` -- decode-first with the ``dynamo`` policy at current Dynamo's defaults
  (conditional disaggregation, ``isl_bounding``): local iff fewer than 2048 tokens
  are uncached and the uncached share is under 0.7
  (:mod:`pd_orchestrator.policies.peers`).
* ``dynamo-load`` -- the same with Dynamo's ``isl_or_load`` rule: also local when the
  picked prefiller is busy.
* ``dynamo-legacy`` -- decode-first with Dynamo 0.1-0.3's rule: remote prefill iff
  more than 1000 tokens are uncached and fewer than 2 requests wait for a prefiller.

  The three ``dynamo`` strategies pick their prefiller as Dynamo's KV-aware prefill
  router does, ``llm-d`` as llm-d's sample prefill profile (prefix 2, queue 1),
  ``always-pd`` as vllm-router's ``cache_aware``
  (:class:`~pd_orchestrator.bench.prefill_picks.PrefillPick`); the others take the
  prefill profile's first pick.
* ``llm-d`` -- decode-first with the ``llm-d`` policy: remote prefill iff at least
  ``nonCachedTokens`` are uncached on the decoder; llm-d's default (0) turns P/D off,
  so the bench sets 1000, legacy Dynamo's length (the two then differ by the queue
  rule).
* ``static-<v>`` -- decode-first with a fixed threshold ``v`` (a sweep).
* ``load-adaptive`` -- decode-first with the ``load-adaptive`` policy (defaults).
* ``slo-feedback`` -- decode-first with the ``slo-feedback`` policy (defaults), its
  targets the benchmark's SLO (TTFT p90 and ITL p99).
* ``goodput`` -- decode-first with the ``goodput`` cost model, its targets the
  benchmark's SLO (TTFT and TPOT).
* any name bound in a policy file (:func:`load_policy_file`): decode-first with a
  ``threshold.policy`` block, so every policy the gateway can run drops in without
  code here.

A decode-first strategy carries the gateway's whole ``threshold`` block
(:class:`~pd_orchestrator.config.policy.ThresholdConfig`, client thresholds not
honoured); :meth:`Strategy.resolver` builds it with the gateway's own
:func:`~pd_orchestrator.policies.build_threshold` and registry, a fresh resolver per
run (policies such as ``slo-feedback`` learn as they go). Strategies only describe;
the virtual fleet and the live runner carry them out.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from pd_orchestrator.bench.prefill_picks import PrefillPick
from pd_orchestrator.bench.results import Slo
from pd_orchestrator.config.policy import ThresholdConfig
from pd_orchestrator.model.records import record
from pd_orchestrator.policies import PolicyConfigError, ThresholdResolver, build_threshold
from pd_orchestrator.policies.plugins import builtin_registry

__all__ = [
    "DEFAULT_STRATEGIES",
    "Mode",
    "Strategy",
    "load_policy_file",
    "resolve_strategies",
]

DEFAULT_STRATEGIES = (
    "always-pd",
    "decode-only",
    "dynamo",
    "dynamo-load",
    "dynamo-legacy",
    "llm-d",
    "static-0.3",
    "static-0.5",
    "static-0.7",
    "static-0.9",
    "load-adaptive",
    "slo-feedback",
    "goodput",
)


class Mode(enum.StrEnum):
    """How requests are served."""

    DECODE_FIRST = "decode-first"
    PREFILL_FIRST = "prefill-first"
    DECODE_ONLY = "decode-only"


@record
class Strategy:
    """A named mode; decode-first strategies carry their ``threshold`` block;
    ``prefill_pick``: how the strategy's system picks a P/D request's prefiller
    (:mod:`pd_orchestrator.bench.prefill_picks`)."""

    name: str
    mode: Mode
    threshold: ThresholdConfig | None = None
    description: str = ""
    prefill_pick: PrefillPick = PrefillPick.PROFILE

    def __post_init__(self) -> None:
        if (self.mode is Mode.DECODE_FIRST) != (self.threshold is not None):
            raise ValueError(f"strategy {self.name!r}: decode-first, and only it, has a threshold")

    def resolver(self) -> ThresholdResolver | None:
        """A fresh resolver of the strategy's threshold (None unless decode-first),
        built as the gateway builds it."""
        if self.threshold is None:
            return None
        return build_threshold(self.threshold, builtin_registry())


def _threshold(block: Mapping[str, Any]) -> ThresholdConfig:
    """A ``threshold`` block of ``block`` (a ``threshold.policy``), built once to check it."""
    config = ThresholdConfig.model_validate({"policy": dict(block), "honour_client": False})
    build_threshold(config, builtin_registry())
    return config


def load_policy_file(path: Path) -> dict[str, ThresholdConfig]:
    """Named policies from YAML: ``{name: <threshold.policy block>}``.

    Each block is validated and built as the gateway's ``threshold.policy`` would
    be; errors name the entry.
    """
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of policy names to policy blocks")
    policies: dict[str, ThresholdConfig] = {}
    for name, block in data.items():
        if not isinstance(block, dict):
            raise ValueError(f"{path}: policy {name!r}: expected a threshold.policy mapping")
        try:
            policies[str(name)] = _threshold(block)
        except (ValidationError, PolicyConfigError) as exc:
            raise ValueError(f"{path}: policy {name!r}: {exc}") from None
    return policies


def _static(name: str) -> Strategy:
    try:
        value = float(name.removeprefix("static-"))
    except ValueError:
        raise ValueError(f"{name!r}: static strategies are named static-<threshold>") from None
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name!r}: the threshold must be within [0, 1]")
    threshold = _threshold({"type": "static", "value": value})
    return Strategy(name, Mode.DECODE_FIRST, threshold, f"decode-first, threshold {value:g}")


def _fixed(slo: Slo) -> dict[str, Strategy]:
    """The built-in strategies with fixed names."""
    slo_params = {"ttft_p90": slo.ttft, "itl_p99": slo.tpot}
    goodput_params = {
        "ttft": slo.ttft,
        "tpot": slo.tpot,
        "ttft_scale": slo.ttft_scale,
        "attainment": slo.attainment,
    }
    return {
        "always-pd": Strategy(
            "always-pd",
            Mode.PREFILL_FIRST,
            None,
            "prefill-first always, vllm-router's P/D mode (cache_aware prefill pick)",
            PrefillPick.CACHE_AWARE,
        ),
        "decode-only": Strategy(
            "decode-only", Mode.DECODE_ONLY, None, "all instances decode, threshold 0"
        ),
        "dynamo": Strategy(
            "dynamo",
            Mode.DECODE_FIRST,
            _threshold({"type": "dynamo"}),
            "decode-first, Dynamo's conditional disaggregation (isl_bounding: local iff"
            " < 2048 uncached and uncached share < 0.7; KV-aware prefill router)",
            PrefillPick.DYNAMO_KV,
        ),
        "dynamo-load": Strategy(
            "dynamo-load",
            Mode.DECODE_FIRST,
            _threshold({"type": "dynamo", "params": {"policy": "isl_or_load"}}),
            "decode-first, Dynamo's conditional disaggregation (isl_or_load: isl_bounding"
            " or a busy prefiller; KV-aware prefill router)",
            PrefillPick.DYNAMO_KV,
        ),
        "dynamo-legacy": Strategy(
            "dynamo-legacy",
            Mode.DECODE_FIRST,
            _threshold({"type": "dynamo-legacy"}),
            "decode-first, Dynamo 0.1-0.3's rule: remote above 1000 uncached tokens,"
            " queue < 2; KV-aware prefill router",
            PrefillPick.DYNAMO_KV,
        ),
        "llm-d": Strategy(
            "llm-d",
            Mode.DECODE_FIRST,
            _threshold({"type": "llm-d", "params": {"non_cached_tokens": 1000}}),
            "decode-first, llm-d's rule: remote from 1000 uncached tokens; prefix and queue"
            " prefill scorers",
            PrefillPick.LLM_D,
        ),
        "load-adaptive": Strategy(
            "load-adaptive",
            Mode.DECODE_FIRST,
            _threshold({"type": "load-adaptive"}),
            "decode-first, load-adaptive (defaults)",
        ),
        "goodput": Strategy(
            "goodput",
            Mode.DECODE_FIRST,
            _threshold({"type": "goodput", "params": goodput_params}),
            f"decode-first, goodput cost model ({slo.describe()})",
        ),
        "slo-feedback": Strategy(
            "slo-feedback",
            Mode.DECODE_FIRST,
            _threshold({"type": "slo-feedback", "params": slo_params}),
            f"decode-first, slo-feedback (TTFT p90 {slo.ttft:g}s, ITL p99 {slo.tpot:g}s)",
        ),
    }


def resolve_strategies(
    names: Iterable[str],
    policies: Mapping[str, ThresholdConfig] | None = None,
    slo: Slo | None = None,
) -> list[Strategy]:
    """Strategies for ``names``: built-ins (module docstring) and ``policies`` by name;
    ``slo`` sets the targets of ``slo-feedback`` (default :class:`Slo`)."""
    policies = policies or {}
    fixed = _fixed(slo or Slo())
    strategies: list[Strategy] = []
    for name in names:
        if name in policies:
            config = policies[name]
            description = f"decode-first, {config.policy.instance_name}"
            strategies.append(Strategy(name, Mode.DECODE_FIRST, config, description))
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
