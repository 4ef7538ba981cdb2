"""The load reports several gateways share (pure): parsed defensively, summed over
the other gateways, dropped when stale; the fleet and the ``goodput`` policies add
the others' sums to their own."""

from __future__ import annotations

import orjson
import pytest

from pd_orchestrator.fleet.state import FleetState
from pd_orchestrator.model.endpoints import Endpoint, Role
from pd_orchestrator.model.shared_load import (
    MAX_ENTRIES,
    MAX_PEERS,
    LoadReport,
    PeerReports,
    decode,
    encode,
)
from pd_orchestrator.policies.goodput import GoodputPolicy
from pd_orchestrator.policies.goodput_model import DutyCycle, GoodputParams, PoolModel
from tests.policies.helpers import decoder


def test_a_report_reads_back_as_it_was_written() -> None:
    report = LoadReport("g1", {"d0": (3, 4_000)}, {"goodput": {"d0": 1_500.5}})
    assert decode(encode(report)) == report


@pytest.mark.parametrize(
    "data",
    [
        b"not json",
        b"[]",
        b'{"gateway": 7, "endpoints": {}, "kept": {}}',
        b'{"gateway": "", "endpoints": {}, "kept": {}}',
        b'{"gateway": "g", "endpoints": {"d0": [1]}, "kept": {}}',
        b'{"gateway": "g", "endpoints": {"d0": [-1, 0]}, "kept": {}}',
        b'{"gateway": "g", "endpoints": {"d0": [1.5, 0]}, "kept": {}}',
        b'{"gateway": "g", "endpoints": {"d0": [true, 0]}, "kept": {}}',
        b'{"gateway": "g", "endpoints": {}, "kept": {"goodput": {"d0": -5}}}',
        b'{"gateway": "g", "endpoints": {}, "kept": {"goodput": {"d0": "many"}}}',
        b'{"gateway": "g", "endpoints": {}, "kept": {"goodput": [1]}}',
        b'{"gateway": "g", "endpoints": {}}',
    ],
)
def test_anything_else_on_the_subject_is_dropped(data: bytes) -> None:
    assert decode(data) is None


def test_a_report_too_large_is_dropped() -> None:
    endpoints = {f"d{i}": [1, 0] for i in range(MAX_ENTRIES + 1)}
    data = orjson.dumps({"gateway": "g", "endpoints": endpoints, "kept": {}})
    assert decode(data) is None


def test_the_others_reports_are_summed_this_gateway_s_ignored_and_stale_ones_dropped() -> None:
    peers = PeerReports("me", ttl=1.0)
    peers.receive(LoadReport("me", {"d0": (50, 0)}), 0.0)  # its own, echoed back
    peers.receive(LoadReport("a", {"d0": (2, 100), "d1": (1, 0)}, {"goodput": {"d0": 10}}), 0.0)
    peers.receive(LoadReport("b", {"d0": (3, 200)}, {"goodput": {"d0": 5}}), 0.5)
    totals = peers.totals(0.9)
    assert totals.peers == 2
    assert totals.endpoints == {"d0": (5, 300), "d1": (1, 0)}
    assert totals.kept == {"goodput": {"d0": 15.0}}
    # a's report is older than the ttl at 1.2 s: only b's counts
    later = peers.totals(1.2)
    assert later.peers == 1 and later.endpoints == {"d0": (3, 200)}
    # a newer report replaces its gateway's last one
    peers.receive(LoadReport("b", {"d0": (1, 0)}), 1.3)
    assert peers.totals(1.3).endpoints == {"d0": (1, 0)}
    peers.clear()
    assert peers.totals(1.3).peers == 0


def test_the_gateways_remembered_are_bounded() -> None:
    peers = PeerReports("me", ttl=10.0)
    for i in range(MAX_PEERS + 5):
        peers.receive(LoadReport(f"g{i}", {"d0": (1, 0)}), 0.0)
    assert peers.totals(0.0).peers == MAX_PEERS
    # once the old ones are stale, new gateways are heard again
    peers.receive(LoadReport("late", {"d0": (1, 0)}), 11.0)
    assert peers.totals(11.0).peers == 1


def _endpoint(name: str) -> Endpoint:
    return Endpoint(name, f"http://{name}:8000", Role.DECODE, "h200", pool="decode")


def test_the_fleet_counts_the_other_gateways_requests_beside_its_own() -> None:
    fleet = FleetState([_endpoint("d0"), _endpoint("d1")])
    fleet.enter("d0", backlog=1_000)
    assert fleet.own_load() == {"d0": (1, 1_000)}
    fleet.share({"d0": (4, 2_000), "d1": (2, 0), "gone": (9, 9)})
    by_name = {s.endpoint.name: s for s in fleet.snapshot()}
    assert (by_name["d0"].in_flight, by_name["d0"].backlog) == (5, 3_000)
    assert (by_name["d1"].in_flight, by_name["d1"].backlog) == (2, 0)
    assert fleet.own_load() == {"d0": (1, 1_000)}  # what it reports stays its own
    fleet.share({})
    assert {s.endpoint.name: s.in_flight for s in fleet.snapshot()} == {"d0": 1, "d1": 0}


def test_goodput_counts_what_the_other_gateways_kept_at_a_decoder_in_its_share() -> None:
    policy = GoodputPolicy(GoodputParams(ttft=1.0, tpot=0.03))
    model = policy.model
    model.out_mean = 100  # window 3 s
    pool = PoolModel(10_000.0, 10_000.0, itl=0.01)
    busy = decoder(in_flight=8)
    model.duty["d0"] = DutyCycle(3_000.0, 0.0)
    assert model.local_share(busy, 0.0, pool) == pytest.approx(0.1)
    assert model.kept_now(0.0) == {"d0": 3_000.0}
    model.share({"d0": 6_000.0}, 0.0)
    assert model.local_share(busy, 0.0, pool) == pytest.approx(0.3)
    assert model.kept_now(0.0) == {"d0": 3_000.0}  # what it reports stays its own
    model.share({}, 0.0)
    assert model.local_share(busy, 0.0, pool) == pytest.approx(0.1)
