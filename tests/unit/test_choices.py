"""The choices a request makes after its plan, as pure functions of the plan and
what failed (``planner.choices``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pd_orchestrator.model.endpoints import Endpoint, Role
from pd_orchestrator.planner.choices import (
    next_decoder,
    next_prefiller,
    sidecar_order,
    suspects,
)

D = [Endpoint(f"d{i}", f"http://d{i}", Role.DECODE) for i in range(4)]
P = [Endpoint(f"p{i}", f"http://p{i}", Role.PREFILL) for i in range(3)]


@dataclass
class Fleet:
    unhealthy: set[str] = field(default_factory=set)
    suspect: set[str] = field(default_factory=set)

    def is_healthy(self, name: str) -> bool:
        return name not in self.unhealthy and name not in self.suspect

    def is_suspect(self, name: str) -> bool:
        return name in self.suspect


def test_next_decoder_prefers_one_not_failed_and_in_routing() -> None:
    fleet = Fleet(unhealthy={"d1"})
    assert next_decoder(D[:3], (), {"d0"}, fleet) == D[2]


def test_next_decoder_takes_one_out_of_routing_before_a_spare() -> None:
    fleet = Fleet(unhealthy={"d1"})
    assert next_decoder(D[:2], D, {"d0"}, fleet) == D[1]


def test_next_decoder_falls_to_a_suspect_spare_then_to_none() -> None:
    fleet = Fleet(unhealthy={"d2"}, suspect={"d3"})
    assert next_decoder(D[:2], D, {"d0", "d1"}, fleet) == D[3]  # d2 failed checks: never
    assert next_decoder(D[:2], D, {"d0", "d1", "d3"}, fleet) is None
    assert suspects(D, {"d0"}, fleet) == (D[3],)


def test_next_prefiller_order() -> None:
    fleet = Fleet(unhealthy={"p0"})
    assert next_prefiller(P, [], set(), fleet) == P[1]  # in routing first
    assert next_prefiller(P, [], {"p1", "p2"}, fleet) == P[0]  # then not failed
    assert next_prefiller(P, ["p0"], {"p0", "p1", "p2"}, fleet) == P[1]  # then untried
    tried = ["p0", "p1", "p2", "p0"]
    assert next_prefiller(P, tried, {"p0", "p1", "p2"}, fleet) == P[1]  # then in turn
    assert next_prefiller((), [], set(), fleet) is None


def test_sidecar_order_rotates_reproducibly_and_spreads() -> None:
    named = tuple(P)
    first = sidecar_order(named, "req-1")
    assert sidecar_order(named, "req-1") == first and sorted(first, key=str) == sorted(P, key=str)
    heads = {sidecar_order(named, f"req-{i}")[0].name for i in range(60)}
    assert heads == {"p0", "p1", "p2"}
    assert sidecar_order(named[:1], "req-1") == named[:1]
