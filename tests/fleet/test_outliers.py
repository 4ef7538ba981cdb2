"""Outlier detection: passive ejection from what real traffic shows (pure, a fake clock)."""

from __future__ import annotations

import pytest

from pd_orchestrator.config.settings import OutlierConfig
from pd_orchestrator.fleet.outliers import may_eject
from pd_orchestrator.fleet.state import FleetState
from pd_orchestrator.model.endpoints import Endpoint, Role
from pd_orchestrator.upstream.errors import (
    UpstreamProtocolError,
    UpstreamStatusError,
    UpstreamTimeout,
    UpstreamUnavailable,
)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _decoders(count: int) -> list[Endpoint]:
    return [Endpoint(f"d{i}", f"http://d{i}", Role.DECODE) for i in range(count)]


def _fleet(count: int = 4, **outlier: float) -> tuple[FleetState, Clock, list[tuple[str, str]]]:
    clock, ejected = Clock(), []
    config = OutlierConfig(**{"max_ejection_percent": 50.0, **outlier})  # type: ignore[arg-type]
    fleet = FleetState(
        [*_decoders(count), Endpoint("p0", "http://p0", Role.PREFILL)],
        outlier=config,
        clock=clock,
        on_eject=lambda name, reason: ejected.append((name, reason)),
    )
    return fleet, clock, ejected


def _5xx(name: str) -> UpstreamStatusError:
    return UpstreamStatusError(name, "decode", 500, "boom")


def _fail(fleet: FleetState, name: str, times: int, error: type = UpstreamStatusError) -> None:
    for _ in range(times):
        if error is UpstreamStatusError:
            fleet.record_error(name, _5xx(name))
        else:
            fleet.record_error(name, error(name, "decode", "gone"))


def test_consecutive_5xx_eject_and_an_answer_in_between_resets_the_count() -> None:
    fleet, _, ejected = _fleet()
    _fail(fleet, "d0", 4)
    fleet.record_success("d0")
    _fail(fleet, "d0", 4)
    assert fleet.is_healthy("d0") and not ejected
    _fail(fleet, "d0", 1)
    assert not fleet.is_healthy("d0") and ejected == [("d0", "consecutive_5xx")]
    assert not next(s for s in fleet.snapshot(Role.DECODE) if s.endpoint.name == "d0").healthy


@pytest.mark.parametrize("error", [UpstreamUnavailable, UpstreamTimeout, UpstreamProtocolError])
def test_consecutive_connection_failures_eject(error: type) -> None:
    fleet, _, ejected = _fleet()
    _fail(fleet, "d1", 5, error)
    assert ejected == [("d1", "consecutive_failures")]


def test_a_4xx_is_an_answer() -> None:
    fleet, _, ejected = _fleet()
    _fail(fleet, "d0", 4)
    fleet.record_error("d0", UpstreamStatusError("d0", "decode", 400, "bad request"))
    _fail(fleet, "d0", 4)
    assert not ejected


def test_a_counter_at_zero_is_off() -> None:
    fleet, _, ejected = _fleet(consecutive_5xx=0)
    _fail(fleet, "d0", 50)
    assert not ejected and fleet.is_healthy("d0")


def test_active_health_checks_do_not_reset_the_passive_count() -> None:
    fleet, _, ejected = _fleet()
    for _ in range(5):
        fleet.record_check("d0", True)
        _fail(fleet, "d0", 1)
    assert ejected == [("d0", "consecutive_5xx")]


def test_an_ejected_endpoint_returns_after_its_time_once_it_answers() -> None:
    fleet, clock, _ = _fleet(base_ejection_time=30.0)
    _fail(fleet, "d0", 5)
    clock.now += 29.0
    fleet.record_check("d0", True)
    fleet.record_success("d0")  # answers, but its time is not up
    assert not fleet.is_healthy("d0")
    clock.now += 1.0
    assert not fleet.is_healthy("d0")  # its time is up, but it has not answered yet
    fleet.record_check("d0", True)
    assert fleet.is_healthy("d0")


def test_a_request_answered_brings_it_back_too() -> None:
    fleet, clock, _ = _fleet(base_ejection_time=30.0)
    _fail(fleet, "d0", 5)
    clock.now += 31.0
    fleet.record_success("d0")
    assert fleet.is_healthy("d0")


def _ejections(fleet: FleetState, clock: Clock, times: int, stay: float) -> list[float]:
    """Eject d0 ``times`` times, each time back in routing for ``stay`` seconds after
    its ejection ends; the seconds of each ejection."""
    seconds = []
    for _ in range(times):
        _fail(fleet, "d0", 5)
        outlier = fleet.outlier_of("d0")
        assert outlier is not None and outlier.ejected_until is not None
        seconds.append(outlier.ejected_until - clock.now)
        clock.now = outlier.ejected_until
        fleet.record_check("d0", True)
        clock.now += stay
    return seconds


def test_ejection_time_grows_with_each_ejection_up_to_the_maximum() -> None:
    fleet, clock, ejected = _fleet(base_ejection_time=10.0, max_ejection_time=25.0)
    assert _ejections(fleet, clock, 3, stay=0.0) == [10.0, 20.0, 25.0] and len(ejected) == 3


def test_the_count_of_ejections_starts_over_after_a_long_stay() -> None:
    fleet, clock, _ = _fleet(base_ejection_time=10.0, max_ejection_time=60.0)
    _fail(fleet, "d0", 5)
    clock.now += 10.0
    fleet.record_check("d0", True)
    clock.now += 60.0  # in routing for max_ejection_time
    _fail(fleet, "d0", 5)
    outlier = fleet.outlier_of("d0")
    assert outlier is not None and outlier.ejections == 1


def test_each_interval_back_in_routing_takes_one_ejection_off() -> None:
    # A decoder restarted once a minute: 2 s base, back in routing 50 s of each minute.
    fleet, clock, _ = _fleet(base_ejection_time=2.0, max_ejection_time=300.0)
    # not 2, 4, 6, 8, 10: each minute's stay took them off
    assert _ejections(fleet, clock, 5, stay=50.0) == [2.0] * 5


def test_an_endpoint_failing_again_soon_after_its_return_stays_out_longer() -> None:
    fleet, clock, _ = _fleet(base_ejection_time=10.0, max_ejection_time=300.0)
    _fail(fleet, "d0", 5)  # out 10 s
    clock.now += 10.0
    fleet.record_check("d0", True)
    clock.now += 25.0  # two intervals in routing: 1 - 2 leaves none
    _fail(fleet, "d0", 5)
    outlier = fleet.outlier_of("d0")
    assert outlier is not None and outlier.ejections == 1
    clock.now += 10.0
    fleet.record_check("d0", True)
    clock.now += 5.0  # less than one interval
    _fail(fleet, "d0", 5)
    assert outlier.ejections == 2 and outlier.ejected_until == clock.now + 20.0


def test_never_more_than_the_share_of_a_role_and_never_the_last_one() -> None:
    fleet, _, ejected = _fleet(count=4, max_ejection_percent=50.0)
    for name in ("d0", "d1", "d2"):
        _fail(fleet, name, 5)
    assert [name for name, _ in ejected] == ["d0", "d1"]  # half of four
    fleet, _, ejected = _fleet(count=2, max_ejection_percent=100.0)
    _fail(fleet, "d0", 5)
    _fail(fleet, "d1", 5)
    assert [name for name, _ in ejected] == ["d0"]  # d1 is the last in routing
    assert fleet.is_healthy("d1")


def test_an_endpoint_down_by_health_checks_does_not_count_as_in_routing() -> None:
    fleet, _, ejected = _fleet(count=2, max_ejection_percent=100.0)
    fleet.mark_unhealthy("d1")
    _fail(fleet, "d0", 5)
    assert not ejected  # d0 is the only decoder still in routing


def test_at_least_one_may_be_ejected_whatever_the_share() -> None:
    assert may_eject(OutlierConfig(max_ejection_percent=10.0), 2, 0, 1)
    assert not may_eject(OutlierConfig(max_ejection_percent=10.0), 2, 1, 1)
    assert not may_eject(OutlierConfig(max_ejection_percent=100.0), 5, 0, 0)


def test_roles_are_counted_apart() -> None:
    fleet, _, ejected = _fleet(count=2, max_ejection_percent=100.0)
    _fail(fleet, "p0", 5)
    assert not ejected  # the only prefiller
    _fail(fleet, "d0", 5)
    assert ejected == [("d0", "consecutive_5xx")]


def test_a_reload_keeps_the_ejections_of_unchanged_endpoints() -> None:
    fleet, clock, _ = _fleet()
    _fail(fleet, "d0", 5)
    fresh = FleetState(_decoders(4), outlier=fleet.outlier, clock=clock)
    fresh.inherit(fleet)
    assert not fresh.is_healthy("d0") and fresh.is_healthy("d1")


def test_a_run_must_cover_the_requests_in_flight_when_it_began() -> None:
    fleet, _, ejected = _fleet()
    for _ in range(20):
        fleet.enter("d0")  # twenty requests in flight
    for _ in range(5):  # five fail at once, ahead of the others
        fleet.leave("d0")
        _fail(fleet, "d0", 1)
    assert not ejected  # fifteen sent before them may still succeed
    fleet.leave("d0")
    fleet.record_success("d0")  # one does: the run is over
    for _ in range(13):  # a new run: fourteen were in flight when it began
        fleet.leave("d0")
        _fail(fleet, "d0", 1)
    assert not ejected and fleet.is_healthy("d0")
    fleet.leave("d0")
    _fail(fleet, "d0", 1)  # the last of them failed too: every one did
    assert ejected == [("d0", "consecutive_5xx")]


def test_an_endpoint_failing_everything_in_flight_is_ejected_after_them() -> None:
    fleet, _, ejected = _fleet()
    for _ in range(8):
        fleet.enter("d0")
    for count in range(8):
        fleet.leave("d0")
        _fail(fleet, "d0", 1)
        assert bool(ejected) == (count == 7)  # the run covers all eight only at the end
