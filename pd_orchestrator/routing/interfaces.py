"""The plugin interfaces of a routing profile, all synchronous and pure.

A profile run is ``filters -> weighted scorers -> picker``:

- a :class:`Filter` returns the candidates it keeps (a subset, in input order);
- a :class:`Scorer` returns one raw score per candidate (same order); the engine,
  not the scorer, clamps each score to [0, 1] (NaN counts as 0) and weights it;
- a :class:`Picker` returns the index of the chosen candidate among the scored ones.

Plugins read only their arguments and their own parameters: no I/O, no clock other
than ``request.now``, no hidden randomness. Factories receive a
:class:`PluginContext` that says where the instance lives.

A plugin that learns from routing decisions (a prefix cache that remembers where
each prompt went) also implements :class:`Observer`; the caller reports each
decision through :meth:`~pd_orchestrator.routing.engine.Profile.observe` after the
run. A run itself never changes any state, so it stays a pure function of the
request, the candidates and the state observed so far.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

from pd_orchestrator.model.endpoints import Endpoint
from pd_orchestrator.model.load import Candidate
from pd_orchestrator.model.records import record
from pd_orchestrator.routing.types import RoutingRequest, ScoredCandidate

__all__ = ["Filter", "Observer", "Picker", "PluginContext", "PluginContractError", "Scorer"]


class PluginContractError(RuntimeError):
    """A plugin returned something its interface does not allow (the engine checks
    every run: :mod:`pd_orchestrator.routing.engine`)."""


@record
class PluginContext:
    """Where a plugin instance is built: its profile and its instance name."""

    profile: str
    name: str


class Filter(Protocol):
    def filter(
        self, request: RoutingRequest, candidates: Sequence[Candidate]
    ) -> Sequence[Candidate]:
        """The candidates kept: a subset of ``candidates``, in their order."""
        ...


class Scorer(Protocol):
    def score(self, request: RoutingRequest, candidates: Sequence[Candidate]) -> Sequence[float]:
        """One raw score per candidate, in order; higher is better (clamped by the engine)."""
        ...


class Picker(Protocol):
    def pick(self, request: RoutingRequest, scored: Sequence[ScoredCandidate]) -> int:
        """The index in ``scored`` (never empty) of the chosen candidate."""
        ...


@runtime_checkable
class Observer(Protocol):
    def observe(self, request: RoutingRequest, chosen: Endpoint) -> None:
        """``request`` was sent to ``chosen`` (called after the run, once per decision)."""
        ...
