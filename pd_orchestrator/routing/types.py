"""The values a routing profile works on: loads, candidates, requests and results.

All are immutable. A profile run sees a :class:`RoutingRequest` and a sequence of
:class:`Candidate` and returns a :class:`RoutingResult`; nothing else flows between
plugins.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import field, replace

from pd_orchestrator.model.endpoints import Endpoint, Role
from pd_orchestrator.model.load import Candidate
from pd_orchestrator.model.records import record

__all__ = ["PrefixFields", "RoutingRequest", "RoutingResult", "ScoredCandidate"]


@record
class RoutingRequest:
    """What plugins may know about the request being routed.

    ``role``: the role wanted (decode or prefill). ``now``: the caller's clock
    (the clock of :attr:`LoadSnapshot.observed_at`). ``model``: the requested
    model (None: any). ``prompt``: the prompt text, when a plugin needs it.
    ``affinity_key``: a short key that should map to the same endpoint among
    equals (a conversation's opening, a session id). ``token_ids``: the prompt's
    token ids when known. ``lora`` and ``cache_salt``: what else separates prefix
    caches. ``decoder``: for prefill routing, the decoder the KV goes to.
    ``allowed_pairs``: ``(prefill_group, decode_group)`` pairs this request may
    join across groups, on top of the configured ones. ``allowed_connector_pairs``:
    ``(prefill connector, decode connector)`` bridges between different connectors
    (``compatibility.connector_bridges``). ``sequence``: a counter the caller
    advances per request; pickers derive rotation and random draws from it.
    """

    role: Role
    now: float
    model: str | None = None
    prompt: str | None = None
    affinity_key: str | None = None
    token_ids: tuple[int, ...] | None = None
    lora: str | None = None
    cache_salt: str | None = None
    decoder: Endpoint | None = None
    allowed_pairs: frozenset[tuple[str, str]] = frozenset()
    allowed_connector_pairs: frozenset[tuple[str, str]] = frozenset()
    sequence: int = 0


@record
class ScoredCandidate:
    """A candidate, its weighted total and each scorer's clamped score: ``values``, in
    the order of the scorers named in ``names`` (:attr:`scores` by name)."""

    candidate: Candidate
    total: float
    values: tuple[float, ...] = ()
    names: tuple[str, ...] = ()

    @property
    def scores(self) -> dict[str, float]:
        """Each scorer's clamped score by its name (made when asked: the ranking makes
        one of these per candidate of every request, and only explanations read it)."""
        return dict(zip(self.names, self.values, strict=True))

    @property
    def endpoint(self) -> Endpoint:
        return self.candidate.endpoint


@record
class RoutingResult:
    """The outcome of one profile run.

    ``ranked``: the pick first, then the other candidates that passed the filters
    by descending total (ties in input order); empty when the filters left none.
    ``dropped``: how many candidates each filter removed, by filter name, in
    pipeline order.
    """

    profile: str
    ranked: tuple[ScoredCandidate, ...]
    dropped: Mapping[str, int] = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        return not self.ranked

    @property
    def pick(self) -> ScoredCandidate | None:
        """The chosen candidate, None when the filters left none."""
        return self.ranked[0] if self.ranked else None

    @property
    def endpoints(self) -> tuple[Endpoint, ...]:
        """The ranked endpoints (the pick first)."""
        return tuple([scored.candidate.endpoint for scored in self.ranked])

    def describe_drops(self) -> str:
        """``healthy dropped 2, model dropped 1`` (for an error message); ``""`` when none."""
        return ", ".join(f"{name} dropped {n}" for name, n in self.dropped.items() if n)


@record
class PrefixFields:
    """The prefix-related fields of a :class:`RoutingRequest`."""

    prompt: str | None = None
    token_ids: tuple[int, ...] | None = None
    lora: str | None = None
    cache_salt: str | None = None

    def apply(self, request: RoutingRequest) -> RoutingRequest:
        """``request`` with these fields set."""
        return replace(
            request,
            prompt=self.prompt,
            token_ids=self.token_ids,
            lora=self.lora,
            cache_salt=self.cache_salt,
        )
