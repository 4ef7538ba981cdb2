"""The peers' disaggregation rules as threshold policies: ``dynamo``,
``dynamo-legacy`` and ``llm-d``.

Each says, per request, whether the peer would prefill remotely; the policy sends the
threshold that makes the decoder keep the prompt exactly when the peer would keep it
local (the decoder admits iff its hit ratio ``h / n >= t``; ``u = n - h`` uncached,
Dynamo's *effective ISL*: the prompt less the prefix cached on the decode worker).

``dynamo`` -- current NVIDIA Dynamo's conditional disaggregation (>= 1.5,
``--router-conditional-disagg``; ``docs/.../conditional-disaggregation.md``,
``lib/kv-router/src/conditional_disagg.rs``), one of its three ``policy`` values:

* ``isl_bounding`` (Dynamo's default): local iff ``u < eff_isl_threshold`` (2048)
  *and* ``u / max(n, 1) < eff_isl_ratio_threshold`` (0.7), both strict. A cold
  prompt (ratio 1) therefore always goes remote, however short.
* ``prefill_load``: local iff the prefill worker Dynamo's router would pick is busy:
  ``active_prefill_tokens > prefill_busy_threshold x max_num_batched_tokens``. The
  pick is the KV-aware prefill router's (lowest queued prompt blocks less the cached
  credit); the policy does not see the prefillers' caches, so it takes the least
  backlogged compatible prefiller (``Candidate.backlog``: the prompt tokens sent to
  it without a first answer yet, the tokens Dynamo keeps charged until the first
  token). ``prefill_busy_threshold`` falls back in Dynamo to
  ``--router-queue-threshold``, whose default drifted (4.0, then 16.0, then off);
  this keeps 4.0 so that ``isl_or_load`` differs from ``isl_bounding``.
  ``max_num_batched_tokens`` is the prefillers' chunk (8192 here). No prefiller: calm.
* ``isl_or_load``: local iff either holds.

The threshold for the ISL bound is ``uncached_budget_threshold(n, U)`` with ``U``
the smallest uncached count that is not local (so the decoder rejects iff
``u >= U``); a busy prefiller sends 0. The optional decode guard
(``decode_busy_threshold``, off by default) is not modelled.

``dynamo-legacy`` -- Dynamo 0.1-0.3's ``DisaggregatedRouter``
(``prefill_remote(prefill_length, prefix_hit_length, queue_size)`` in
``lib/llm/src/disagg_router.rs`` and the vLLM example's ``disagg_router.py``):
remote prefill iff the uncached length exceeds ``max_local_prefill_length``
(default 1000) *and* the prefill queue is shorter than ``max_prefill_queue_size``
(default 2). Dynamo's queue is the one shared queue prefill workers pull from; here
it is what waits at the compatible prefillers beyond the request each is busy with:
``sum(max(0, max(in_flight, running + waiting) - 1))`` over them (the gateway's own
count is fresher than a scraped reading; a reading carries what other gateways
sent). A full queue sends threshold 0 (the decoder prefills); otherwise::

    t = 1 - (max_local_prefill_length + 1/2) / n     (0 when n <= max_local)

so the decoder rejects iff ``u > max_local_prefill_length``.

``llm-d`` -- llm-d-inference-scheduler's prefix disaggregation decider
(``pkg/plugins/profile/prefix_based_pd_decider.go``, ``prefix-based-pd-decider``,
v0.4): disaggregate iff ``nonCachedTokens > 0`` and the uncached tokens of the
prompt on the chosen decode pod reach ``nonCachedTokens`` (default 0: never). llm-d
estimates the decode pod's cached prefix from its own index and the prompt's bytes
(4 characters a token); here the decoder measures its own cache, so the rule is
applied exactly::

    t = 1 - (non_cached_tokens - 1/2) / n             (0 when non_cached_tokens == 0)

so the decoder rejects iff ``u >= non_cached_tokens``. The half token keeps the
decoder's floating-point comparison away from the boundary.
"""

from __future__ import annotations

import math
from typing import Annotated, ClassVar, Literal

from pydantic import Field

from pd_orchestrator.model.load import Candidate
from pd_orchestrator.model.records import record
from pd_orchestrator.model.route import Route, at
from pd_orchestrator.policies.base import (
    POLICY,
    Leaf,
    ThresholdContext,
)
from pd_orchestrator.policies.min_uncached import uncached_budget_threshold
from pd_orchestrator.routing.interfaces import PluginContext
from pd_orchestrator.routing.registry import NoParams, PluginType

__all__ = [
    "DYNAMO",
    "DYNAMO_LEGACY",
    "LLM_D",
    "DynamoLegacyParams",
    "DynamoLegacyPolicy",
    "DynamoParams",
    "DynamoPolicy",
    "LlmdParams",
    "LlmdPolicy",
    "isl_bound",
    "prefill_queue",
]


def prefill_queue(prefillers: tuple[Candidate, ...]) -> int:
    """Requests waiting at ``prefillers`` beyond the one each is serving (see the
    module docstring)."""
    queued = 0
    for candidate in prefillers:
        load = candidate.load
        outstanding = candidate.in_flight
        if load is not None:
            outstanding = max(outstanding, load.running + load.waiting)
        queued += max(0, outstanding - 1)
    return queued


class DynamoLegacyParams(NoParams):
    """``max_local_prefill_length`` (default 1000): uncached tokens above which Dynamo
    prefills remotely; ``max_prefill_queue_size`` (default 2): ...unless this many
    requests already wait for a prefiller."""

    max_local_prefill_length: Annotated[int, Field(ge=0)] = 1000
    max_prefill_queue_size: Annotated[int, Field(ge=0)] = 2


@record
class DynamoLegacyPolicy(Leaf):
    """Dynamo 0.1-0.3's disaggregated router (module docstring). Reasons:
    ``short-prompt``, ``prefill-queue-full``, ``uncached-length``."""

    max_local_prefill_length: int = 1000
    max_prefill_queue_size: int = 2
    name: str = "dynamo-legacy"
    bounds: ClassVar[tuple[float, float]] = (0.0, 1.0)

    def decide(self, context: ThresholdContext) -> Route:
        limit = self.max_local_prefill_length
        if context.prompt_tokens <= limit:
            return at(0.0, self.name, "short-prompt")
        if prefill_queue(context.prefillers) >= self.max_prefill_queue_size:
            return at(0.0, self.name, "prefill-queue-full")
        threshold = uncached_budget_threshold(context.prompt_tokens, limit + 1)
        return at(threshold, self.name, "uncached-length")


DynamoRule = Literal["isl_bounding", "prefill_load", "isl_or_load"]


def isl_bound(prompt_tokens: int, eff_isl_threshold: int, ratio_threshold: float) -> int:
    """The smallest uncached count ``u`` that Dynamo's ``isl_bounding`` does not keep
    local for a ``prompt_tokens`` prompt: ``u >= eff_isl_threshold`` or
    ``u / max(prompt_tokens, 1) >= ratio_threshold`` (the same float comparison)."""
    total = max(prompt_tokens, 1)
    bound = min(eff_isl_threshold, math.ceil(ratio_threshold * total))
    while bound > 0 and (bound - 1) / total >= ratio_threshold:
        bound -= 1
    while bound < eff_isl_threshold and bound / total < ratio_threshold:
        bound += 1
    return max(bound, 0)


class DynamoParams(NoParams):
    """Dynamo's ``--router-conditional-disagg-config`` (module docstring): ``policy``
    (default ``isl_bounding``), ``eff_isl_threshold`` (2048), ``eff_isl_ratio_threshold``
    (0.7), ``prefill_busy_threshold`` (4.0, in ``max_num_batched_tokens``),
    ``max_num_batched_tokens`` (8192)."""

    policy: DynamoRule = "isl_bounding"
    eff_isl_threshold: Annotated[int, Field(ge=0)] = 2048
    eff_isl_ratio_threshold: Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)] = 0.7
    prefill_busy_threshold: Annotated[float, Field(ge=0.0, allow_inf_nan=False)] = 4.0
    max_num_batched_tokens: Annotated[int, Field(ge=1)] = 8192


@record
class DynamoPolicy(Leaf):
    """Current Dynamo's conditional disaggregation (module docstring). Reasons:
    ``prefill-busy`` (local: the picked prefiller is busy), ``effective-isl`` (the
    ISL bound sets the threshold), ``remote`` (no uncached count is local: P/D)."""

    rule: DynamoRule = "isl_bounding"
    eff_isl_threshold: int = 2048
    eff_isl_ratio_threshold: float = 0.7
    prefill_busy_threshold: float = 4.0
    max_num_batched_tokens: int = 8192
    name: str = "dynamo"
    bounds: ClassVar[tuple[float, float]] = (0.0, 1.0)

    def prefill_busy(self, prefillers: tuple[Candidate, ...]) -> bool:
        """Whether the least backlogged prefiller (Dynamo's pick, module docstring)
        has more than ``prefill_busy_threshold x max_num_batched_tokens`` prompt
        tokens outstanding; no prefiller counts as calm."""
        if not prefillers:
            return False
        least = min(candidate.backlog for candidate in prefillers)
        return least > self.prefill_busy_threshold * self.max_num_batched_tokens

    def decide(self, context: ThresholdContext) -> Route:
        if self.rule != "isl_bounding" and self.prefill_busy(context.prefillers):
            return at(0.0, self.name, "prefill-busy")
        if self.rule == "prefill_load":
            return at(1.0, self.name, "remote")
        bound = isl_bound(
            context.prompt_tokens, self.eff_isl_threshold, self.eff_isl_ratio_threshold
        )
        if bound <= 0:
            return at(1.0, self.name, "remote")
        threshold = uncached_budget_threshold(context.prompt_tokens, bound)
        return at(threshold, self.name, "effective-isl")


class LlmdParams(NoParams):
    """``non_cached_tokens`` (default 0: never disaggregate, as llm-d): uncached tokens
    from which llm-d prefills remotely."""

    non_cached_tokens: Annotated[int, Field(ge=0)] = 0


@record
class LlmdPolicy(Leaf):
    """llm-d's prefix disaggregation decider (module docstring). Reasons: ``disabled``,
    ``short-prompt``, ``non-cached-tokens``."""

    non_cached_tokens: int = 0
    name: str = "llm-d"
    bounds: ClassVar[tuple[float, float]] = (0.0, 1.0)

    def decide(self, context: ThresholdContext) -> Route:
        limit = self.non_cached_tokens
        if limit <= 0:
            return at(0.0, self.name, "disabled")
        if context.prompt_tokens < limit:
            return at(0.0, self.name, "short-prompt")
        threshold = uncached_budget_threshold(context.prompt_tokens, limit)
        return at(threshold, self.name, "non-cached-tokens")


def _dynamo(params: DynamoParams, context: PluginContext) -> DynamoPolicy:
    return DynamoPolicy(
        params.policy,
        params.eff_isl_threshold,
        params.eff_isl_ratio_threshold,
        params.prefill_busy_threshold,
        params.max_num_batched_tokens,
        context.name,
    )


def _dynamo_legacy(params: DynamoLegacyParams, context: PluginContext) -> DynamoLegacyPolicy:
    return DynamoLegacyPolicy(
        params.max_local_prefill_length, params.max_prefill_queue_size, context.name
    )


def _llm_d(params: LlmdParams, context: PluginContext) -> LlmdPolicy:
    return LlmdPolicy(params.non_cached_tokens, context.name)


DYNAMO = PluginType("dynamo", POLICY, DynamoParams, _dynamo)
DYNAMO_LEGACY = PluginType("dynamo-legacy", POLICY, DynamoLegacyParams, _dynamo_legacy)
LLM_D = PluginType("llm-d", POLICY, LlmdParams, _llm_d)
