"""Builders of endpoints, candidates and requests for routing tests."""

from __future__ import annotations

from collections.abc import Sequence

from pd_orchestrator.model.endpoints import Endpoint, Role
from pd_orchestrator.model.load import Candidate, LoadSnapshot
from pd_orchestrator.routing import RoutingRequest, ScoredCandidate


def endpoint(
    name: str,
    role: Role = Role.DECODE,
    *,
    hardware: str = "h200",
    model: str | None = None,
    group: str = "default",
) -> Endpoint:
    return Endpoint(name, f"http://{name}:8000", role, hardware, model, group=group)


def load(running: int = 0, waiting: int = 0, kv: float = 0.0, at: float = 0.0) -> LoadSnapshot:
    return LoadSnapshot(running=running, waiting=waiting, kv_usage=kv, observed_at=at)


def candidate(
    name: str,
    role: Role = Role.DECODE,
    *,
    healthy: bool = True,
    in_flight: int = 0,
    reading: LoadSnapshot | None = None,
    hardware: str = "h200",
    model: str | None = None,
    group: str = "default",
) -> Candidate:
    ep = endpoint(name, role, hardware=hardware, model=model, group=group)
    return Candidate(ep, healthy, in_flight, reading)


def request(role: Role = Role.DECODE, **fields: object) -> RoutingRequest:
    return RoutingRequest(role, 100.0, **fields)  # type: ignore[arg-type]


def scored(*totals: float) -> list[ScoredCandidate]:
    return [ScoredCandidate(candidate(f"e{i}"), total) for i, total in enumerate(totals)]


def names(candidates: Sequence[Candidate]) -> list[str]:
    return [c.endpoint.name for c in candidates]
