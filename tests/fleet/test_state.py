"""Active health in the fleet state: failed checks, and late ones on a busy endpoint."""

from __future__ import annotations

from pd_orchestrator.fleet.endpoints import Endpoint, Role
from pd_orchestrator.fleet.state import FleetState

D0 = Endpoint("d0", "http://d0", Role.DECODE)


def test_failed_checks_in_a_row_mark_an_endpoint_unhealthy_and_one_pass_heals_it() -> None:
    fleet = FleetState([D0], unhealthy_after=2)
    fleet.record_check("d0", False)
    assert fleet.is_healthy("d0")
    fleet.record_check("d0", False)
    assert not fleet.is_healthy("d0")
    fleet.record_check("d0", True)
    assert fleet.is_healthy("d0")


def test_a_late_check_does_not_count_against_an_endpoint_that_answers_requests() -> None:
    fleet = FleetState([D0], unhealthy_after=2)
    for _ in range(5):
        fleet.record_success("d0")  # a request was answered since the previous check
        fleet.record_check("d0", False, late=True)
    assert fleet.is_healthy("d0")


def test_late_checks_count_when_no_request_was_answered_since() -> None:
    fleet = FleetState([D0], unhealthy_after=2)
    fleet.record_success("d0")
    fleet.record_check("d0", False, late=True)  # forgiven: a request was answered
    fleet.record_check("d0", False, late=True)
    fleet.record_check("d0", False, late=True)
    assert not fleet.is_healthy("d0")  # stopped: it answers nothing any more
