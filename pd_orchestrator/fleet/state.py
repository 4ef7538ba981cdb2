"""Mutable fleet state: health and in-flight requests per endpoint.

The planner never sees this object, only immutable snapshots
(:meth:`FleetState.snapshot`), so its decisions are pure functions of a moment.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from connectors import PeerUpdate
from pd_orchestrator.fleet.endpoints import Endpoint, Role

__all__ = ["EndpointStatus", "FleetState"]


@dataclass(frozen=True, slots=True)
class EndpointStatus:
    """A snapshot of one endpoint."""

    endpoint: Endpoint
    healthy: bool
    in_flight: int


class FleetState:
    """Health (active checks plus passive failures) and in-flight counts."""

    def __init__(self, endpoints: Iterable[Endpoint], unhealthy_after: int = 2) -> None:
        self._endpoints = {e.name: e for e in endpoints}
        self._healthy = dict.fromkeys(self._endpoints, True)
        self._failures = dict.fromkeys(self._endpoints, 0)
        self._in_flight = dict.fromkeys(self._endpoints, 0)
        self.unhealthy_after = unhealthy_after
        self.checked_once = False
        self._learned: dict[str, PeerUpdate] = {}

    def endpoints(self, role: Role | None = None) -> list[Endpoint]:
        """Endpoints able to play ``role`` (``both`` endpoints count for either)."""
        return [e for e in self._endpoints.values() if _plays(e, role)]

    def get(self, name: str) -> Endpoint:
        return self._endpoints[name]

    def snapshot(self, role: Role | None = None) -> tuple[EndpointStatus, ...]:
        """Immutable statuses of the endpoints with ``role`` (all when None)."""
        return tuple(
            EndpointStatus(e, self._healthy[e.name], self._in_flight[e.name])
            for e in self.endpoints(role)
        )

    def inherit(self, previous: FleetState) -> None:
        """Keep the health of endpoints that ``previous`` had under the same name and URL."""
        for name, endpoint in self._endpoints.items():
            old = previous._endpoints.get(name)
            if old is not None and old.url == endpoint.url:
                self._healthy[name] = previous._healthy[name]
                self._failures[name] = previous._failures[name]
        self.checked_once = previous.checked_once

    def status(self, name: str) -> EndpointStatus:
        """A snapshot of one configured endpoint."""
        endpoint = self._endpoints[name]
        return EndpointStatus(endpoint, self._healthy[name], self._in_flight[name])

    def is_healthy(self, name: str) -> bool:
        return self._healthy.get(name, True)

    def _track(self, name: str) -> None:
        """Start tracking an endpoint that is not configured (a sidecar header's)."""
        if name not in self._healthy:
            self._healthy[name] = True
            self._failures[name] = 0
            self._in_flight[name] = 0

    def record_success(self, name: str) -> None:
        self._track(name)
        self._failures[name] = 0
        self._healthy[name] = True

    def record_failure(self, name: str) -> None:
        """One failed check or connection; enough in a row mark the endpoint unhealthy."""
        self._track(name)
        self._failures[name] += 1
        if self._failures[name] >= self.unhealthy_after:
            self._healthy[name] = False

    def mark_unhealthy(self, name: str) -> None:
        self._track(name)
        self._failures[name] = max(self._failures[name], self.unhealthy_after)
        self._healthy[name] = False

    def enter(self, name: str) -> None:
        """One more request in flight on ``name`` (pair with :meth:`leave`)."""
        if name not in self._in_flight:
            self._track(name)
        self._in_flight[name] += 1

    def leave(self, name: str) -> None:
        """One request in flight on ``name`` ended."""
        self._in_flight[name] -= 1

    @contextmanager
    def in_flight(self, name: str) -> Iterator[None]:
        """Count one request in flight on ``name`` for the duration of the block."""
        self.enter(name)
        try:
            yield
        finally:
            self.leave(name)

    def learned(self, name: str) -> PeerUpdate | None:
        """What answers and lookups taught about ``name``'s connector addresses."""
        return self._learned.get(name)

    def learn(self, name: str, update: PeerUpdate) -> None:
        self._learned[name] = update

    def forget(self, name: str) -> None:
        self._learned.pop(name, None)

    def any_decoder_healthy(self) -> bool:
        return any(self._healthy[e.name] for e in self.endpoints(Role.DECODE))


def _plays(endpoint: Endpoint, role: Role | None) -> bool:
    if role is None or role is Role.BOTH:
        return True
    return endpoint.role.decodes if role is Role.DECODE else endpoint.role.prefills
