"""The peers' disaggregation rules as threshold policies: ``dynamo`` and ``llm-d``.

Each says, per request, whether the peer would prefill remotely; the policy sends the
threshold that makes the decoder keep the prompt exactly when the peer would keep it
local (the decoder admits iff its hit ratio ``h / n >= t``; ``u = n - h`` uncached).

``dynamo`` -- NVIDIA Dynamo's conditional disaggregation (the ``DisaggregatedRouter``
of Dynamo 0.1-0.3: ``prefill_remote(prefill_length, prefix_hit_length, queue_size)``
in ``lib/llm/src/disagg_router.rs`` and the vLLM example's ``disagg_router.py``):
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

from dataclasses import dataclass
from typing import Annotated, ClassVar

from pydantic import Field

from pd_orchestrator.model.load import Candidate
from pd_orchestrator.model.route import Route, at
from pd_orchestrator.policies.base import (
    POLICY,
    LatencyObservation,
    Leaf,
    ThresholdContext,
)
from pd_orchestrator.policies.min_uncached import uncached_budget_threshold
from pd_orchestrator.routing.interfaces import PluginContext
from pd_orchestrator.routing.registry import NoParams, PluginType

__all__ = [
    "DYNAMO",
    "LLM_D",
    "DynamoParams",
    "DynamoPolicy",
    "LlmdParams",
    "LlmdPolicy",
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


class DynamoParams(NoParams):
    """``max_local_prefill_length`` (default 1000): uncached tokens above which Dynamo
    prefills remotely; ``max_prefill_queue_size`` (default 2): ...unless this many
    requests already wait for a prefiller."""

    max_local_prefill_length: Annotated[int, Field(ge=0)] = 1000
    max_prefill_queue_size: Annotated[int, Field(ge=0)] = 2


@dataclass(frozen=True, slots=True)
class DynamoPolicy(Leaf):
    """Dynamo's conditional disaggregation (module docstring). Reasons: ``short-prompt``,
    ``prefill-queue-full``, ``uncached-length``."""

    max_local_prefill_length: int = 1000
    max_prefill_queue_size: int = 2
    name: str = "dynamo"
    bounds: ClassVar[tuple[float, float]] = (0.0, 1.0)

    def decide(self, context: ThresholdContext) -> Route:
        limit = self.max_local_prefill_length
        if context.prompt_tokens <= limit:
            return at(0.0, self.name, "short-prompt")
        if prefill_queue(context.prefillers) >= self.max_prefill_queue_size:
            return at(0.0, self.name, "prefill-queue-full")
        threshold = uncached_budget_threshold(context.prompt_tokens, limit + 1)
        return at(threshold, self.name, "uncached-length")

    def observe(self, observation: LatencyObservation) -> None:
        return None


class LlmdParams(NoParams):
    """``non_cached_tokens`` (default 0: never disaggregate, as llm-d): uncached tokens
    from which llm-d prefills remotely."""

    non_cached_tokens: Annotated[int, Field(ge=0)] = 0


@dataclass(frozen=True, slots=True)
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

    def observe(self, observation: LatencyObservation) -> None:
        return None


def _dynamo(params: DynamoParams, context: PluginContext) -> DynamoPolicy:
    return DynamoPolicy(
        params.max_local_prefill_length, params.max_prefill_queue_size, context.name
    )


def _llm_d(params: LlmdParams, context: PluginContext) -> LlmdPolicy:
    return LlmdPolicy(params.non_cached_tokens, context.name)


DYNAMO = PluginType("dynamo", POLICY, DynamoParams, _dynamo)
LLM_D = PluginType("llm-d", POLICY, LlmdParams, _llm_d)
