"""The values a routing profile works on: loads, candidates, requests and results.

All are immutable. A profile run sees a :class:`RoutingRequest` and a sequence of
:class:`Candidate` and returns a :class:`RoutingResult`; nothing else flows between
plugins.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from pd_orchestrator.fleet.endpoints import Endpoint, Role
from pd_orchestrator.fleet.state import EndpointStatus

__all__ = ["Candidate", "LoadSnapshot", "RoutingRequest", "RoutingResult", "ScoredCandidate"]


@dataclass(frozen=True, slots=True)
class LoadSnapshot:
    """One reading of an endpoint's load (from its ``/metrics``).

    ``running`` and ``waiting`` are request counts, ``kv_usage`` the KV-cache
    usage in [0, 1], ``prefix_hit_rate`` the share of queried prompt tokens served
    from the prefix cache over the last poll window (None when unknown),
    ``preemptions`` the preemptions over that window and ``observed_at`` the
    time of the reading on the caller's clock (the one requests carry as ``now``).
    """

    running: int
    waiting: int
    kv_usage: float
    observed_at: float
    prefix_hit_rate: float | None = None
    preemptions: int = 0

    def __post_init__(self) -> None:
        if self.running < 0 or self.waiting < 0 or self.preemptions < 0:
            raise ValueError("request and preemption counts must be >= 0")
        if not 0.0 <= self.kv_usage <= 1.0:
            raise ValueError(f"kv_usage {self.kv_usage} is outside [0, 1]")
        rate = self.prefix_hit_rate
        if rate is not None and not 0.0 <= rate <= 1.0:
            raise ValueError(f"prefix_hit_rate {rate} is outside [0, 1]")
        if not math.isfinite(self.observed_at):
            raise ValueError("observed_at must be finite")

    @property
    def queue_depth(self) -> int:
        """Requests running plus waiting."""
        return self.running + self.waiting

    def age(self, now: float) -> float:
        """Seconds since the reading at ``now`` (never negative)."""
        return max(0.0, now - self.observed_at)


@dataclass(frozen=True, slots=True)
class Candidate:
    """An endpoint a profile may choose.

    ``healthy``: the caller's verdict (health checks and load polls).
    ``in_flight``: requests the gateway itself has on the endpoint now.
    ``load``: the latest fresh reading; None when stale or never read.
    """

    endpoint: Endpoint
    healthy: bool = True
    in_flight: int = 0
    load: LoadSnapshot | None = None

    @classmethod
    def from_status(
        cls, status: EndpointStatus, load: LoadSnapshot | None = None, *, responsive: bool = True
    ) -> Candidate:
        """A candidate from a fleet snapshot; ``responsive`` is the load poller's verdict."""
        return cls(status.endpoint, status.healthy and responsive, status.in_flight, load)


@dataclass(frozen=True, slots=True)
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


@dataclass(frozen=True, slots=True)
class ScoredCandidate:
    """A candidate, its weighted total and each scorer's clamped score (by name)."""

    candidate: Candidate
    total: float
    scores: Mapping[str, float] = field(default_factory=dict)

    @property
    def endpoint(self) -> Endpoint:
        return self.candidate.endpoint


@dataclass(frozen=True, slots=True)
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
        return tuple(scored.endpoint for scored in self.ranked)

    def describe_drops(self) -> str:
        """``healthy dropped 2, model dropped 1`` (for an error message); ``""`` when none."""
        return ", ".join(f"{name} dropped {n}" for name, n in self.dropped.items() if n)
