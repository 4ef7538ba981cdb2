"""A profile run: filters, then weighted scorers, then the picker.

1. Each filter in order keeps a subset of the candidates; when none are left the
   run stops and returns an empty result (the caller answers 503).
2. Each scorer gives one raw score per remaining candidate. The engine clamps
   every score to [0, 1] (NaN counts as 0) and adds ``weight * score`` to the
   candidate's total.
3. The picker chooses one candidate. The result lists it first, then the others
   by descending total, ties in input order.

The run is a pure function of the request, the candidates and the plugins'
parameters and state. State changes only through :meth:`Profile.observe`, which
the caller invokes with the endpoint a request was finally sent to; it reaches
every plugin implementing :class:`~pd_orchestrator.routing.interfaces.Observer`.

A plugin that breaks its contract (a filter that adds candidates, a
scorer that returns the wrong number of scores, a picker that returns an index
out of range) raises :class:`PluginContractError` naming it. Filters that declare
``trusted = True`` (the built-in ones, which only ever keep a subsequence of what
they get) skip the subset check, which cost more than they do; the flag is read
once, when the profile is built, as the scorers' names are.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import field
from itertools import repeat
from operator import add, attrgetter, mul
from typing import Generic, TypeVar

from pd_orchestrator.model.endpoints import Endpoint
from pd_orchestrator.model.load import Candidate
from pd_orchestrator.model.records import record
from pd_orchestrator.routing.interfaces import (
    Filter,
    Observer,
    Picker,
    PluginContractError,
    Scorer,
)
from pd_orchestrator.routing.types import RoutingRequest, RoutingResult, ScoredCandidate

__all__ = ["PluginContractError", "Profile", "Stage", "WeightedScorer", "clamp"]

PluginT = TypeVar("PluginT")


def clamp(score: float) -> float:
    """``score`` limited to [0, 1]; NaN becomes 0."""
    if math.isnan(score):
        return 0.0
    return min(1.0, max(0.0, score))


@record
class Stage(Generic[PluginT]):
    """A named plugin instance of a profile."""

    name: str
    type: str
    plugin: PluginT


@record
class WeightedScorer:
    """A named scorer instance and the weight of its clamped score."""

    name: str
    type: str
    weight: float
    plugin: Scorer


@record
class Profile:
    """A built pipeline; :meth:`run` routes one request."""

    name: str
    filters: tuple[Stage[Filter], ...]
    scorers: tuple[WeightedScorer, ...]
    picker: Stage[Picker]
    observers: tuple[Observer, ...] = field(init=False, default=())
    _stages: tuple[tuple[str, Filter, bool], ...] = field(
        init=False, default=(), repr=False, compare=False
    )
    """Each filter's name, plugin and ``trusted`` flag, in filter order."""
    _names: tuple[str, ...] = field(init=False, default=(), repr=False, compare=False)
    """The scorers' names, in scorer order (each scored candidate's ``names``)."""

    def __post_init__(self) -> None:
        # What the plugins are is fixed at build time, not asked per request: which
        # learn, which filters are trusted, what the scorers are called.
        observers = tuple(p for p in self.plugins() if isinstance(p, Observer))
        object.__setattr__(self, "observers", observers)
        stages = tuple(
            (s.name, s.plugin, bool(getattr(s.plugin, "trusted", False))) for s in self.filters
        )
        object.__setattr__(self, "_stages", stages)
        object.__setattr__(self, "_names", tuple(scorer.name for scorer in self.scorers))

    def run(self, request: RoutingRequest, candidates: Sequence[Candidate]) -> RoutingResult:
        """Rank ``candidates`` for ``request``; see the module docstring."""
        kept, dropped = self._filter(request, tuple(candidates))
        if not kept:
            return RoutingResult(self.name, (), dropped)
        scored = self._score(request, kept)
        chosen = self.picker.plugin.pick(request, scored)
        if not 0 <= chosen < len(scored):
            raise PluginContractError(
                f"picker {self.picker.name!r} returned index {chosen} of {len(scored)}"
            )
        return RoutingResult(self.name, _ranked(scored, chosen), dropped)

    def plugins(self) -> tuple[object, ...]:
        """Every plugin instance, in pipeline order."""
        return (
            *(stage.plugin for stage in self.filters),
            *(scorer.plugin for scorer in self.scorers),
            self.picker.plugin,
        )

    def observe(self, request: RoutingRequest, chosen: Endpoint) -> None:
        """Tell every observing plugin that ``request`` was sent to ``chosen``."""
        for plugin in self.observers:
            plugin.observe(request, chosen)

    def _filter(
        self, request: RoutingRequest, candidates: tuple[Candidate, ...]
    ) -> tuple[tuple[Candidate, ...], dict[str, int]]:
        dropped: dict[str, int] = {}
        for name, plugin, trusted in self._stages:
            if not candidates:
                break
            kept = tuple(plugin.filter(request, candidates))
            if not trusted and not _subset(kept, candidates):
                raise PluginContractError(f"filter {name!r} returned a new candidate")
            dropped[name] = len(candidates) - len(kept)
            candidates = kept
        return candidates, dropped

    def _score(
        self, request: RoutingRequest, candidates: tuple[Candidate, ...]
    ) -> tuple[ScoredCandidate, ...]:
        scorers = self.scorers
        if not scorers:
            return tuple([ScoredCandidate(candidate, 0.0) for candidate in candidates])
        # each total is 0.0 + w1 * s1 + w2 * s2 ..., summed in scorer order, in C
        columns: list[tuple[float, ...]] = []
        totals: list[float] = [0.0] * len(candidates)
        for scorer in scorers:
            column = self._clamped(scorer, request, candidates)
            columns.append(column)
            totals = list(map(add, totals, map(mul, repeat(scorer.weight), column)))
        rows = zip(*columns)  # noqa: B905 - every column is as long (checked by _clamped)
        return tuple(map(ScoredCandidate, candidates, totals, rows, repeat(self._names)))

    @staticmethod
    def _clamped(
        scorer: WeightedScorer, request: RoutingRequest, candidates: tuple[Candidate, ...]
    ) -> tuple[float, ...]:
        raw = scorer.plugin.score(request, candidates)
        if len(raw) != len(candidates):
            raise PluginContractError(
                f"scorer {scorer.name!r} returned {len(raw)} scores for {len(candidates)} "
                "candidates"
            )
        # clamp() inline: this runs for every candidate and scorer of every request
        return tuple([
            (1.0 if v >= 1.0 else v if v > 0.0 else 0.0) if v == v else 0.0
            for v in map(float, raw)
        ])  # fmt: skip


def _subset(kept: tuple[Candidate, ...], offered: tuple[Candidate, ...]) -> bool:
    """Whether every candidate of ``kept`` is one of ``offered`` (by identity)."""
    if len(kept) == len(offered):
        return all(a is b for a, b in zip(kept, offered, strict=True)) or _ids_within(kept, offered)
    return _ids_within(kept, offered)


def _ids_within(kept: tuple[Candidate, ...], offered: tuple[Candidate, ...]) -> bool:
    ids = {id(c) for c in offered}
    return all(id(c) in ids for c in kept)


def _ranked(scored: tuple[ScoredCandidate, ...], chosen: int) -> tuple[ScoredCandidate, ...]:
    # a stable sort keeps equal totals in input order, reversed or not
    rest = [s for i, s in enumerate(scored) if i != chosen]
    rest.sort(key=_TOTAL, reverse=True)
    return (scored[chosen], *rest)


_TOTAL = attrgetter("total")
