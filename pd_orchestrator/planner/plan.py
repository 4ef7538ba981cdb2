"""Plans from the routing pipeline (pure: candidates and the clock come in).

The decode profile ranks decoders for a request; the plan keeps that order (the
first is asked first, the others are fallbacks or, in ask-all mode, the other
legs) and the threshold the policy chose for the first. Prefillers are ranked
later, for the decoder that actually needs them, by the prefill profile with that
decoder on the request (the compatibility filter keeps its group).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pd_orchestrator.fleet.endpoints import Endpoint, Role
from pd_orchestrator.flows.request import ClientRequest
from pd_orchestrator.policies.base import ThresholdDecision
from pd_orchestrator.prefix.runtime import PrefixFields
from pd_orchestrator.routing.profiles import RoutingProfiles
from pd_orchestrator.routing.types import Candidate, RoutingRequest, RoutingResult

__all__ = ["NoCandidateError", "Plan", "Planner", "routing_request"]


class NoCandidateError(LookupError):
    """The filters left no endpoint; the message says which filter dropped what."""


@dataclass(frozen=True, slots=True)
class Plan:
    """Decoders in the order to try them, the chosen one's candidate and the threshold."""

    decoders: tuple[Endpoint, ...]
    threshold: ThresholdDecision
    ranking: RoutingResult
    request: RoutingRequest

    @property
    def decoder(self) -> Endpoint:
        return self.decoders[0]


def routing_request(
    request: ClientRequest,
    role: Role,
    now: float,
    sequence: int,
    *,
    decoder: Endpoint | None = None,
    allowed_pairs: frozenset[tuple[str, str]] = frozenset(),
    fields: PrefixFields | None = None,
) -> RoutingRequest:
    """What the routing plugins see of a client request (``fields``: its prompt text,
    token ids, LoRA and cache salt, for the prefix-aware scorers)."""
    routing = RoutingRequest(
        role=role,
        now=now,
        model=request.model,
        affinity_key=request.affinity_key(),
        decoder=decoder,
        allowed_pairs=allowed_pairs,
        sequence=sequence,
    )
    return routing if fields is None else fields.apply(routing)


@dataclass(frozen=True)
class Planner:
    """Runs the routing profiles; ``allowed_pairs`` are the host-staged group pairs."""

    profiles: RoutingProfiles
    allowed_pairs: frozenset[tuple[str, str]] = frozenset()

    def plan(
        self,
        request: ClientRequest,
        candidates: Sequence[Candidate],
        now: float,
        sequence: int,
        threshold: Callable[[Candidate], ThresholdDecision],
        fields: PrefixFields | None = None,
    ) -> Plan:
        """Rank decoders; ``threshold`` is asked about the first one."""
        routing = routing_request(request, Role.DECODE, now, sequence, fields=fields)
        result = self.profiles.decode.run(routing, candidates)
        pick = result.pick
        if pick is None:
            raise NoCandidateError(_why("decoder", result))
        return Plan(result.endpoints, threshold(pick.candidate), result, routing)

    def routed(self, plan: Plan, decoder: Endpoint) -> None:
        """Tell the decode profile's learning plugins which decoder took the request."""
        self.profiles.decode.observe(plan.request, decoder)

    def rank(
        self,
        request: ClientRequest,
        candidates: Sequence[Candidate],
        now: float,
        sequence: int,
        fields: PrefixFields | None = None,
    ) -> RoutingResult:
        """The decode profile's ranking of the decoders for ``request``."""
        return self.profiles.decode.run(
            routing_request(request, Role.DECODE, now, sequence, fields=fields), candidates
        )

    def prefillers(
        self,
        request: ClientRequest,
        decoder: Endpoint,
        candidates: Sequence[Candidate],
        now: float,
        sequence: int,
        fields: PrefixFields | None = None,
    ) -> tuple[Endpoint, ...]:
        """Prefillers whose KV can reach ``decoder``, best first (may be empty)."""
        routing = routing_request(
            request,
            Role.PREFILL,
            now,
            sequence,
            decoder=decoder,
            allowed_pairs=self.allowed_pairs,
            fields=fields,
        )
        return self.profiles.prefill.run(routing, candidates).endpoints


def _why(what: str, result: RoutingResult) -> str:
    drops = result.describe_drops()
    return f"no {what} can take this request" + (f" ({drops})" if drops else "")
