"""Active health in the fleet state: failed checks, and late ones on a busy endpoint."""

from __future__ import annotations

from pd_orchestrator.config.settings import OutlierConfig
from pd_orchestrator.fleet.state import FleetState
from pd_orchestrator.model.endpoints import Endpoint, Role
from pd_orchestrator.upstream.client import Phase
from pd_orchestrator.upstream.errors import UpstreamProtocolError, UpstreamUnavailable

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


def test_a_break_makes_a_suspect_until_the_endpoint_answers_or_a_check_passes() -> None:
    fleet = FleetState([D0], unhealthy_after=2)
    fleet.mark_unhealthy("d0")
    assert not fleet.is_healthy("d0") and fleet.is_suspect("d0")
    fleet.record_check("d0", True)
    assert fleet.is_healthy("d0") and not fleet.is_suspect("d0")
    fleet.mark_unhealthy("d0")
    fleet.record_accepted("d0")  # a stream to it began
    assert fleet.is_healthy("d0") and not fleet.is_suspect("d0")


def test_a_failed_check_or_connection_makes_a_suspect_plainly_unhealthy() -> None:
    fleet = FleetState([D0], unhealthy_after=2)
    fleet.mark_unhealthy("d0")
    fleet.record_check("d0", False)
    assert not fleet.is_healthy("d0") and not fleet.is_suspect("d0")


def test_a_stream_that_began_does_not_end_a_run_of_failures() -> None:
    fleet = FleetState([D0], unhealthy_after=2, outlier=OutlierConfig(consecutive_failures=2))
    broken = UpstreamProtocolError("d0", "decode", "connection broken")
    for _ in range(2):
        fleet.record_accepted("d0")  # its status came; then it broke mid-answer
        fleet.record_error("d0", broken)
    outlier = fleet.outlier_of("d0")
    assert outlier is not None and outlier.consecutive_failures == 2
    fleet.record_success("d0")  # an answer read to its end does
    assert outlier.consecutive_failures == 0


def test_endpoints_a_request_named_are_forgotten_past_the_bound_least_recent_idle_first() -> None:
    fleet = FleetState([], max_named=3)
    fleet.enter("busy:1")  # in flight: never forgotten
    for name in ("a:1", "b:1", "c:1", "d:1"):
        fleet.record_error(name, UpstreamUnavailable(name, Phase.PREFILL, "refused"))
    assert fleet.named_count == 3
    assert fleet.outlier_of("a:1") is None and fleet.outlier_of("b:1") is None
    assert fleet.outlier_of("busy:1") is not None and fleet.outlier_of("d:1") is not None
    fleet.leave("busy:1")


def test_a_prompt_s_blocks_are_pending_until_its_first_answer_or_its_end() -> None:
    fleet = FleetState([D0])
    fleet.enter("d0", 3000, (1, 2, 3))
    fleet.enter("d0", 500, (1, 2, 4))
    assert fleet.pending.leading((1, 2, 3), "d0") == 3
    fleet.answered("d0", 3000, (1, 2, 3))
    assert fleet.pending.leading((1, 2, 3), "d0") == 2  # the other prompt holds 1, 2
    fleet.leave("d0", 500, (1, 2, 4))  # it ended before its first answer
    assert fleet.pending.keys("d0") == 0
    assert fleet.status("d0").backlog == 0


def test_the_backlog_counts_prompt_tokens_until_their_first_answer() -> None:
    fleet = FleetState([D0])
    fleet.enter("d0", 3000)
    fleet.enter("d0", 500)
    assert fleet.status("d0").backlog == 3500 and fleet.status("d0").in_flight == 2
    fleet.answered("d0", 3000)  # its first token: still in flight, out of the backlog
    assert fleet.status("d0").backlog == 500 and fleet.status("d0").in_flight == 2
    [status] = fleet.snapshot()
    assert status.backlog == 500
    fleet.answered("gone:1", 7)  # never seen: nothing to take off
    fleet.enter("named:1", 42)  # an endpoint a request named is tracked alike
    fleet.answered("named:1", 42)
    fleet.leave("named:1")
