"""The decode-first plan: a decoder, its fallbacks, the prefillers, the threshold.

Candidates are ordered healthy first. Among healthy ones, those within ``slack``
requests in flight of the least loaded are ranked by rendezvous hashing of the
request's affinity key (the start of its prompt), so a conversation's next turn
goes back to the decoder that holds its prefix while load stays balanced; the
rest follow by load. Without a key, ties rotate with ``turn`` (a counter the
caller advances per request). Unhealthy endpoints stay at the end as a last resort.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pd_orchestrator.fleet.endpoints import Endpoint
from pd_orchestrator.fleet.state import EndpointStatus
from pd_orchestrator.policies.base import ThresholdDecision

__all__ = ["Plan", "order_candidates", "plan_decode_first"]


@dataclass(frozen=True, slots=True)
class Plan:
    """Decoders in the order to try them, prefillers likewise, and the threshold."""

    decoders: tuple[Endpoint, ...]
    prefillers: tuple[Endpoint, ...]
    threshold: ThresholdDecision

    @property
    def decoder(self) -> Endpoint:
        return self.decoders[0]


def _rendezvous(key: str, name: str) -> int:
    digest = hashlib.blake2b(f"{key}\x00{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def order_candidates(
    statuses: Sequence[EndpointStatus],
    turn: int,
    affinity_key: str | None = None,
    slack: int = 2,
) -> tuple[EndpointStatus, ...]:
    """Order endpoints for one request; see the module docstring."""
    count = max(1, len(statuses))
    least = min((s.in_flight for s in statuses if s.healthy), default=0)

    def rank(item: tuple[int, EndpointStatus]) -> tuple[int, int, int]:
        index, status = item
        if not status.healthy:
            return (2, status.in_flight, index)
        rotation = (index - turn) % count
        if affinity_key is None or status.in_flight > least + slack:
            return (1 if affinity_key is not None else 0, status.in_flight, rotation)
        return (0, -_rendezvous(affinity_key, status.endpoint.name), rotation)

    return tuple(status for _, status in sorted(enumerate(statuses), key=rank))


def plan_decode_first(
    decoders: Sequence[EndpointStatus],
    prefillers: Sequence[EndpointStatus],
    turn: int,
    threshold: Callable[[EndpointStatus], ThresholdDecision],
    affinity_key: str | None = None,
) -> Plan:
    """The plan for one request; ``threshold`` is asked about the chosen decoder."""
    if not decoders:
        raise ValueError("no decoder to plan with")
    ordered = order_candidates(decoders, turn, affinity_key)
    return Plan(
        decoders=tuple(s.endpoint for s in ordered),
        prefillers=tuple(s.endpoint for s in order_candidates(prefillers, turn)),
        threshold=threshold(ordered[0]),
    )
