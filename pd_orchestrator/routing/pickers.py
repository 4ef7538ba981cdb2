"""Built-in pickers: ``max-score`` and ``weighted-random``.

Both are deterministic functions of the scored candidates and the request: the
"randomness" of ``weighted-random`` is a hash of its seed, its instance and the
request's ``sequence``, so a replay of the same requests picks the same way.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

from pd_orchestrator.model.records import record
from pd_orchestrator.routing.interfaces import PluginContext
from pd_orchestrator.routing.plugin_params import MaxScoreParams, WeightedRandomParams
from pd_orchestrator.routing.registry import PICKER, PluginType
from pd_orchestrator.routing.scorers import queue_depth
from pd_orchestrator.routing.types import RoutingRequest, ScoredCandidate

__all__ = [
    "MAX_SCORE",
    "WEIGHTED_RANDOM",
    "MaxScoreParams",
    "MaxScorePicker",
    "WeightedRandomParams",
    "WeightedRandomPicker",
]


def _hash64(*parts: str) -> int:
    digest = hashlib.blake2b("\x00".join(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def _rendezvous(key: str, names: Iterable[str]) -> list[bytes]:
    """``_hash64(key, name)`` of each of ``names``, as its 8 big-endian bytes (bytes of
    one length order as the integers they spell), with ``key`` (up to a few thousand
    characters) hashed once rather than once per tied endpoint: each name continues a
    copy of the hasher that took the key and the separator."""
    taken = hashlib.blake2b((key + "\x00").encode(), digest_size=8)
    digests = []
    for name in names:
        hasher = taken.copy()
        hasher.update(name.encode())
        digests.append(hasher.digest())
    return digests


@record
class MaxScorePicker:
    """``max-score``: the candidate with the highest total.

    Ties (totals within ``tolerance`` of the best) are broken so that equal
    endpoints share the load: with an ``affinity_key`` on the request, by
    rendezvous hashing of the key and the endpoint names (the same key goes to
    the same endpoint while it stays among the best); without one, by rotation:
    the tied candidates in input order, starting at ``sequence`` modulo their count.
    With ``ties: rotate`` the key is ignored: a round-robin among equals. With a
    ``load_bound`` the key's endpoints are tried in hash order and the first whose
    :func:`~pd_orchestrator.routing.scorers.queue_depth` is within the bound takes it
    (consistent hashing with bounded loads): a key stays put until its endpoint is
    crowded, instead of a few keys piling onto one endpoint.
    """

    tolerance: float
    ties: str = "affinity"
    load_bound: float | None = None

    def pick(self, request: RoutingRequest, scored: Sequence[ScoredCandidate]) -> int:
        totals = [s.total for s in scored]
        floor = max(totals) - self.tolerance
        tied = [i for i, total in enumerate(totals) if total >= floor]
        if len(tied) == 1:  # no tie to break: every rule below picks it
            return tied[0]
        key = request.affinity_key if self.ties == "affinity" else None
        if key is None:
            return tied[request.sequence % len(tied)]

        ranks = _rendezvous(key, [scored[i].candidate.endpoint.name for i in tied])
        if self.load_bound is None:
            return tied[ranks.index(max(ranks))]  # the first of equal ranks, as max() keeps
        order = [tied[j] for j in sorted(range(len(tied)), key=ranks.__getitem__, reverse=True)]
        depths = [queue_depth(s.candidate) for s in scored]
        limit = self.load_bound * sum(depths) / len(depths) + 1.0
        return next((i for i in order if depths[i] <= limit), order[0])


@record
class WeightedRandomPicker:
    """``weighted-random``: a draw with probability proportional to the total.

    The draw is a hash of ``seed``, the instance (profile and name) and
    ``request.sequence``; the caller advances ``sequence`` per request. When
    every total is 0 the draw is uniform over the candidates.
    """

    salt: str

    def pick(self, request: RoutingRequest, scored: Sequence[ScoredCandidate]) -> int:
        draw = _hash64(self.salt, str(request.sequence)) / 2**64  # in [0, 1)
        totals = [max(0.0, s.total) for s in scored]
        mass = sum(totals)
        if mass <= 0.0:
            return int(draw * len(scored))
        return _weighted_index(totals, draw * mass)


def _weighted_index(weights: Sequence[float], target: float) -> int:
    """The first index whose cumulative weight exceeds ``target`` (never a zero weight)."""
    cumulative = 0.0
    last_positive = 0
    for index, weight in enumerate(weights):
        if weight <= 0.0:
            continue
        cumulative += weight
        last_positive = index
        if cumulative > target:
            return index
    return last_positive  # rounding left target at the total


def _max_score(params: MaxScoreParams, context: PluginContext) -> MaxScorePicker:
    return MaxScorePicker(params.tolerance, params.ties, params.load_bound)


def _weighted_random(params: WeightedRandomParams, context: PluginContext) -> WeightedRandomPicker:
    return WeightedRandomPicker(f"{params.seed}\x00{context.profile}\x00{context.name}")


MAX_SCORE = PluginType("max-score", PICKER, MaxScoreParams, _max_score)
WEIGHTED_RANDOM = PluginType("weighted-random", PICKER, WeightedRandomParams, _weighted_random)
