"""``min-uncached-tokens``: prefill on the decoder when few tokens are uncached.

Dynamo's rule of thumb: a prompt whose uncached part is short is cheaper to
prefill where it will be decoded than to prefill elsewhere and transfer, whatever
its hit ratio. The policy says so as a threshold for this prompt.

With ``n`` prompt tokens, ``h`` of them cached and the budget ``N``
(``max_uncached_tokens``), the decoder should admit iff ``n - h < N``. It admits iff
``h / n >= t``; the policy sends::

    t = max(0, 1 - (N - 1/2) / n)

so ``h / n >= t`` iff ``h >= n - N + 1/2`` iff (tokens are whole) ``n - h < N``. The
half token keeps the decoder's floating-point comparison away from the boundary.
A prompt shorter than ``N`` gets ``t = 0``: always admitted. With the optional
``max_uncached_ratio`` ``r`` (Dynamo uses 0.7), the uncached share must also stay
within ``r``: ``h / n >= 1 - r``, so ``t = max(t, 1 - r)``.

``n`` is the context's ``prompt_tokens`` (exact or estimated); the decoder counts
only full blocks as cached, so near the boundary it may reject a prompt whose
uncached tail is a partial block: the rule holds at block granularity.

Parameters (:class:`MinUncachedTokensParams`): ``max_uncached_tokens`` (>= 1,
default 2048), ``max_uncached_ratio`` (in [0, 1] or None, default None).
Reasons: ``short-prompt`` (t = 0), ``uncached-tokens`` (the token budget set t),
``uncached-ratio`` (the ratio bound set t). Bounds: ``(1 - r, 1)``, or ``(0, 1)``.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from pd_orchestrator.model.records import record
from pd_orchestrator.model.route import Route, at
from pd_orchestrator.policies.base import (
    POLICY,
    Leaf,
    ThresholdContext,
    clamp_ratio,
)
from pd_orchestrator.routing.interfaces import PluginContext
from pd_orchestrator.routing.registry import NoParams, PluginType

__all__ = [
    "MIN_UNCACHED_TOKENS",
    "MinUncachedTokensParams",
    "MinUncachedTokensPolicy",
    "uncached_budget_threshold",
]


class MinUncachedTokensParams(NoParams):
    """``max_uncached_tokens`` (>= 1, default 2048): prefill on the decoder when fewer
    tokens than this are uncached. ``max_uncached_ratio`` (in [0, 1], default None:
    no bound): ...and only when the uncached share of the prompt is at most this."""

    max_uncached_tokens: Annotated[int, Field(ge=1)] = 2048
    max_uncached_ratio: Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)] | None = None


def uncached_budget_threshold(prompt_tokens: int, max_uncached_tokens: int) -> float:
    """The threshold admitting iff fewer than ``max_uncached_tokens`` of
    ``prompt_tokens`` are uncached (see the module docstring)."""
    if prompt_tokens <= 0:
        return 0.0
    return clamp_ratio(1.0 - (max_uncached_tokens - 0.5) / prompt_tokens)


@record
class MinUncachedTokensPolicy(Leaf):
    """See the module docstring."""

    max_uncached_tokens: int
    max_uncached_ratio: float | None = None
    name: str = "min-uncached-tokens"

    @property
    def bounds(self) -> tuple[float, float]:
        return (self._ratio_floor(), 1.0)

    def _ratio_floor(self) -> float:
        ratio = self.max_uncached_ratio
        return 0.0 if ratio is None else clamp_ratio(1.0 - ratio)

    def decide(self, context: ThresholdContext) -> Route:
        budget = uncached_budget_threshold(context.prompt_tokens, self.max_uncached_tokens)
        floor = self._ratio_floor()
        if floor > budget:
            return at(floor, self.name, "uncached-ratio")
        reason = "short-prompt" if budget == 0.0 else "uncached-tokens"
        return at(budget, self.name, reason)


def _min_uncached(
    params: MinUncachedTokensParams, context: PluginContext
) -> MinUncachedTokensPolicy:
    return MinUncachedTokensPolicy(
        params.max_uncached_tokens, params.max_uncached_ratio, context.name
    )


MIN_UNCACHED_TOKENS = PluginType(
    "min-uncached-tokens", POLICY, MinUncachedTokensParams, _min_uncached
)
