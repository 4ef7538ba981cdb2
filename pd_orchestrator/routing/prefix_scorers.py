"""Prefix-aware scorers: ``precise-prefix``, ``approximate-prefix`` and ``prefix-affinity``.

``precise-prefix`` (from the KV events of each endpoint; needs the shared
:class:`~pd_orchestrator.prefix.index.PreciseIndex`, passed to
:func:`~pd_orchestrator.routing.builtins.builtin_registry`): the fraction of the
request's prompt blocks, hashed from ``request.token_ids`` as vLLM hashes them, that
each candidate holds as a consecutive prefix. Requests without token ids score 0.
Recommended with ``kv-usage`` (weight 3 vs 2) and ``max-score``::

    scorers:
      - {type: precise-prefix, weight: 3}
      - {type: kv-usage, weight: 2}

``approximate-prefix`` (learns from routing decisions; needs ``request.prompt``):
the fraction of the prompt's 64-character chunks last routed to each candidate,
as a consecutive prefix. Candidates that look hot score 0 (queue depth more than
``hot_queue_slack`` above the shallowest candidate's, or KV usage at least
``hot_kv_usage``), so a popular prefix does not pile onto one endpoint.

``prefix-affinity`` (Ray Serve's policy; learns from routing decisions): scores 1
for the one candidate :func:`~pd_orchestrator.prefix.affinity.affinity_choice`
picks and 0 for the others; use it alone (or dominant) with ``max-score``.

``approximate-prefix`` and ``precise-prefix`` give graded scores, so a profile
using them also ranks candidates for ask-all. ``approximate-prefix`` and
``precise-prefix`` score 0 when the best match is below ``min_match_ratio`` (the
expected gain is too small to matter). Keys include the model, the LoRA adapter
and the cache salt, so requests of different adapters or salts never match each
other's prefixes. All three observe the decisions for a share guard
(:mod:`pd_orchestrator.prefix.share`): an endpoint that took more than its fair
share plus ``share_slack`` of the last ``share_window`` decisions has its prefix
ignored until its share falls, so a popular prefix spreads instead of piling up.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Self

from pydantic import Field, model_validator

from pd_orchestrator.model.endpoints import Endpoint
from pd_orchestrator.model.load import Candidate
from pd_orchestrator.prefix.affinity import AffinityParams, PrefixTree, affinity_choice
from pd_orchestrator.prefix.approximate import ApproximatePrefixCache, namespace
from pd_orchestrator.prefix.index import PreciseIndex
from pd_orchestrator.prefix.share import ShareGuard
from pd_orchestrator.routing.interfaces import PluginContext, Scorer
from pd_orchestrator.routing.registry import SCORER, NoParams, PluginType
from pd_orchestrator.routing.scorers import queue_depth
from pd_orchestrator.routing.types import RoutingRequest

__all__ = [
    "APPROXIMATE_PREFIX",
    "PREFIX_AFFINITY",
    "AffinityScorerParams",
    "ApproximatePrefixParams",
    "ApproximatePrefixScorer",
    "PrecisePrefixParams",
    "PrecisePrefixScorer",
    "PrefixAffinityScorer",
    "precise_prefix_type",
]

Ratio = Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)]
Count = Annotated[int, Field(ge=1)]


def _names(candidates: Sequence[Candidate]) -> list[str]:
    return [c.endpoint.name for c in candidates]


def _ratios(matched: dict[str, int], names: Sequence[str], total: int, floor: float) -> list[float]:
    """Matched over total per name; all zero when the best is below ``floor``."""
    if total == 0:
        return [0.0] * len(names)
    ratios = [matched.get(name, 0) / total for name in names]
    return ratios if max(ratios, default=0.0) >= max(floor, 1e-12) else [0.0] * len(names)


class _ShareParams(NoParams):
    """The share guard of every prefix scorer (:mod:`pd_orchestrator.prefix.share`):
    ``share_slack`` (0.1; null: off), how far above the fair share of the last
    ``share_window`` (256) decisions an endpoint may go before its prefix is ignored."""

    share_slack: Ratio | None = 0.1
    share_window: Count = 256


class _Guarded:
    """A scorer that remembers its decisions for the share guard."""

    def __init__(self, params: _ShareParams) -> None:
        self.guard = ShareGuard(params.share_slack, params.share_window)

    def observe(self, request: RoutingRequest, chosen: Endpoint) -> None:
        self.guard.record(chosen.name)


class PrecisePrefixParams(_ShareParams):
    """``min_match_ratio`` (in [0, 1], default 0.05): below this best match, all score
    0 (a preamble every prompt shares must not steer traffic); and the share guard's
    ``share_slack`` and ``share_window``."""

    min_match_ratio: Ratio = 0.05


class PrecisePrefixScorer(_Guarded):
    """``precise-prefix``; see the module docstring."""

    def __init__(self, index: PreciseIndex, params: PrecisePrefixParams) -> None:
        super().__init__(params)
        self.index = index
        self.min_match_ratio = params.min_match_ratio

    def score(self, request: RoutingRequest, candidates: Sequence[Candidate]) -> Sequence[float]:
        names = _names(candidates)
        if not request.token_ids:
            return [0.0] * len(names)
        keys = self.index.keys(request.token_ids, request.lora, request.cache_salt)
        if not keys:
            return [0.0] * len(names)
        matched = self.index.match(keys, names)
        ratios = _ratios(matched, names, len(keys), self.min_match_ratio)
        return [0.0 if over else r for r, over in zip(ratios, self.guard.over(names), strict=True)]

    def memory_bytes(self) -> int:
        return self.index.memory_bytes()


class ApproximatePrefixParams(_ShareParams):
    """``chunk_chars`` (64), ``capacity_per_endpoint`` (31,250 chunks), ``max_chunks``
    (256 leading chunks hashed per prompt), ``min_match_ratio`` (0.05),
    ``hot_queue_slack`` (8 requests; null: off), ``hot_kv_usage`` (0.95; 1 counts
    only a full cache as hot) and the share guard's ``share_slack`` and
    ``share_window``."""

    chunk_chars: Count = 64
    capacity_per_endpoint: Count = 31_250
    max_chunks: Count = 256
    min_match_ratio: Ratio = 0.05
    hot_queue_slack: Annotated[int, Field(ge=0)] | None = 8
    hot_kv_usage: Ratio = 0.95


class _LastKeys:
    """The keys of the last prompt hashed, reused when the same prompt is observed."""

    def __init__(self) -> None:
        self.prompt: str | None = None
        self.space = ""
        self.keys: list[int] = []


class ApproximatePrefixScorer(_Guarded):
    """``approximate-prefix``; see the module docstring."""

    def __init__(self, params: ApproximatePrefixParams) -> None:
        super().__init__(params)
        self.params = params
        self.cache = ApproximatePrefixCache(
            params.chunk_chars, params.capacity_per_endpoint, params.max_chunks
        )
        self._last = _LastKeys()

    def _keys(self, request: RoutingRequest) -> list[int]:
        prompt = request.prompt or ""
        space = namespace(request.model, request.lora, request.cache_salt)
        last = self._last
        if last.prompt is not prompt or last.space != space:
            last.prompt, last.space, last.keys = prompt, space, self.cache.keys(prompt, space)
        return last.keys

    def score(self, request: RoutingRequest, candidates: Sequence[Candidate]) -> Sequence[float]:
        names = _names(candidates)
        keys = self._keys(request)
        matched = self.cache.match(keys, names)
        ratios = _ratios(matched, names, len(keys), self.params.min_match_ratio)
        hot = self._hot(candidates, self.guard.over(names))
        return [0.0 if h else r for r, h in zip(ratios, hot, strict=True)]

    def _hot(self, candidates: Sequence[Candidate], over_share: Sequence[bool]) -> list[bool]:
        slack, limit = self.params.hot_queue_slack, self.params.hot_kv_usage
        depths = [queue_depth(c) for c in candidates]
        shallowest = min(depths, default=0)
        return [
            over
            or (slack is not None and depth - shallowest > slack)
            or (c.load is not None and c.load.kv_usage >= limit)
            for c, depth, over in zip(candidates, depths, over_share, strict=True)
        ]

    def observe(self, request: RoutingRequest, chosen: Endpoint) -> None:
        super().observe(request, chosen)
        keys = self._keys(request)
        if keys:
            self.cache.record(keys, chosen.name)

    def memory_bytes(self) -> int:
        return self.cache.memory_bytes()


class AffinityScorerParams(_ShareParams):
    """Ray Serve's parameters: ``imbalanced_threshold`` (10), ``match_rate_threshold``
    (0.1), ``do_eviction`` (true here: Ray's default is false, but the tree must stay
    bounded), ``eviction_threshold_chars`` (400,000) and ``eviction_target_chars``
    (360,000), per endpoint, checked at every insertion; ``seed`` (0) of the
    power-of-two draws; and the share guard's ``share_slack`` and ``share_window``
    (an endpoint over its share is not preferred for its prefix)."""

    imbalanced_threshold: Annotated[int, Field(ge=0)] = 10
    match_rate_threshold: Ratio = 0.1
    do_eviction: bool = True
    eviction_threshold_chars: Count = 400_000
    eviction_target_chars: Annotated[int, Field(ge=0)] = 360_000
    seed: int = 0

    @model_validator(mode="after")
    def _target_below_threshold(self) -> Self:
        if self.eviction_target_chars > self.eviction_threshold_chars:
            raise ValueError("eviction_target_chars must not exceed eviction_threshold_chars")
        return self


class PrefixAffinityScorer(_Guarded):
    """``prefix-affinity``; see the module docstring."""

    def __init__(self, params: AffinityScorerParams, salt: str) -> None:
        super().__init__(params)
        self.params = params
        self.policy = AffinityParams(params.imbalanced_threshold, params.match_rate_threshold)
        self.tree = PrefixTree()
        self.salt = salt

    @staticmethod
    def _text(request: RoutingRequest) -> str:
        if not request.prompt:
            return ""
        return namespace(request.model, request.lora, request.cache_salt) + "\x1e" + request.prompt

    def score(self, request: RoutingRequest, candidates: Sequence[Candidate]) -> Sequence[float]:
        names = _names(candidates)
        depths = [queue_depth(c) for c in candidates]
        chosen = affinity_choice(
            self.tree,
            self._text(request),
            names,
            depths,
            self.policy,
            seed=self.salt,
            sequence=request.sequence,
            blocked=self.guard.over(names),
        )
        return [1.0 if i == chosen else 0.0 for i in range(len(names))]

    def observe(self, request: RoutingRequest, chosen: Endpoint) -> None:
        super().observe(request, chosen)
        text = self._text(request)
        if not text:
            return
        self.tree.insert(text, chosen.name, request.now)
        params = self.params
        if params.do_eviction and self.tree.chars(chosen.name) > params.eviction_threshold_chars:
            self.tree.evict(chosen.name, params.eviction_target_chars)

    def memory_bytes(self) -> int:
        return self.tree.memory_bytes()


def _approximate(
    params: ApproximatePrefixParams, context: PluginContext
) -> ApproximatePrefixScorer:
    return ApproximatePrefixScorer(params)


def _affinity(params: AffinityScorerParams, context: PluginContext) -> PrefixAffinityScorer:
    return PrefixAffinityScorer(params, f"{params.seed}\x00{context.profile}\x00{context.name}")


def precise_prefix_type(
    index: PreciseIndex | None,
) -> PluginType[PrecisePrefixParams, Scorer]:
    """The ``precise-prefix`` type bound to ``index`` (None: building one is an error)."""

    def factory(params: PrecisePrefixParams, context: PluginContext) -> Scorer:
        if index is None:
            raise ValueError(
                "precise-prefix needs the precise prefix index: configure `prefix.precise` "
                "and pass its index to builtin_registry()"
            )
        return PrecisePrefixScorer(index, params)

    return PluginType("precise-prefix", SCORER, PrecisePrefixParams, factory)


APPROXIMATE_PREFIX = PluginType("approximate-prefix", SCORER, ApproximatePrefixParams, _approximate)
PREFIX_AFFINITY = PluginType("prefix-affinity", SCORER, AffinityScorerParams, _affinity)
