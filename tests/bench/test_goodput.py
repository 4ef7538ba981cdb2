"""The goodput search: the highest rate multiple meeting the attainment goal."""

from __future__ import annotations

import pytest

from pd_orchestrator.bench.goodput import Probe, SearchSettings, pooled, scaled, search
from pd_orchestrator.bench.report import ratios_to_best_other
from pd_orchestrator.bench.workloads import WorkloadOptions, build_workload


def _capacity(limit: float, calls: list[float]) -> object:
    """A fleet whose attainment is 1 up to ``limit`` times the rate, then falls."""

    def probe(multiplier: float) -> Probe:
        calls.append(multiplier)
        attainment = 1.0 if multiplier <= limit else max(0.0, 1.0 - (multiplier - limit))
        return Probe(multiplier, attainment, multiplier * 10, {"decode": min(1.0, multiplier)})

    return probe


@pytest.mark.parametrize("limit", [0.3, 1.0, 2.7, 10.0])
def test_the_search_brackets_then_bisects(limit: float) -> None:
    calls: list[float] = []
    found = search(_capacity(limit, calls), SearchSettings(goal=0.95, bisections=6))  # type: ignore[arg-type]
    assert found.multiplier <= limit + 0.05 and found.multiplier >= limit / 2 ** (1 / 64) - 0.05
    assert found.best is not None and found.best.attainment >= 0.95
    assert len(calls) == len(set(calls)) <= 6 + 8  # no multiplier run twice
    assert [p.multiplier for p in found.probes] == sorted(calls)


def test_a_goal_no_rate_meets_is_goodput_zero_with_every_probe_kept() -> None:
    found = search(lambda m: Probe(m, 0.5, 1.0, {}), SearchSettings(goal=0.9))
    assert found.multiplier == 0.0 and found.best is None
    assert found.probes[0].multiplier == pytest.approx(1 / 64) and len(found.probes) == 7


def test_a_fleet_that_never_saturates_stops_at_the_ceiling() -> None:
    found = search(lambda m: Probe(m, 1.0, 1.0, {}), SearchSettings(ceiling=8.0))
    assert found.multiplier == 8.0


def test_bad_settings_are_refused() -> None:
    for kwargs in ({"goal": 0.0}, {"factor": 1.0}, {"start": 100.0}):
        with pytest.raises(ValueError):
            SearchSettings(**kwargs)  # type: ignore[arg-type]


def test_scaling_divides_arrival_and_think_times() -> None:
    workload = build_workload("multi-turn", WorkloadOptions(requests=20))
    faster = scaled(workload, 4.0)
    assert scaled(workload, 1.0) is workload
    for before, after in zip(workload.requests, faster.requests, strict=True):
        assert after.arrival == pytest.approx(before.arrival / 4)
        assert after.think_time == pytest.approx(before.think_time / 4)
        assert after.segments == before.segments


def test_ratios_are_to_the_best_other_strategy() -> None:
    ratios = ratios_to_best_other({"a": 2.0, "b": 1.0, "c": 0.0})
    assert ratios == {"a": 2.0, "b": 0.5, "c": 0.0}
    assert ratios_to_best_other({"a": 1.0, "b": 0.0})["b"] == 0.0
    assert ratios_to_best_other({"a": 0.0, "b": 0.0})["a"] is None


def test_pooled_runs_count_every_request_once() -> None:
    small = Probe(2.0, 0.5, 10.0, {"decode": 0.4, "prefill": 0.2})
    large = Probe(2.0, 0.8, 20.0, {"decode": 0.6, "prefill": 0.4}, runs=2)
    probe = pooled([small, large], [100, 300])
    # 50 + 240 of 400 requests met the SLO: not the mean of the two shares (0.65)
    assert probe.attainment == pytest.approx(0.725)
    # rate and busy: the mean over the three runs pooled (the second probe is two)
    assert probe.rate == pytest.approx(50.0 / 3)
    assert probe.busy == pytest.approx({"decode": 1.6 / 3, "prefill": 1.0 / 3})
    lone = pooled([small, Probe(2.0, 0.5, 10.0, {"decode": 0.4})], [1, 1])
    assert lone.busy == pytest.approx({"decode": 0.4, "prefill": 0.1})  # idle where absent
    assert (probe.multiplier, probe.runs) == (2.0, 3)
    assert pooled([small], [7]) == small


@pytest.mark.parametrize(
    ("probes", "requests", "why"),
    [
        ([], [], "one or more"),
        ([Probe(1.0, 1.0, 1.0, {})], [1, 2], "one or more"),
        ([Probe(1.0, 1.0, 1.0, {}), Probe(2.0, 1.0, 1.0, {})], [1, 1], "different multipliers"),
    ],
)
def test_pooling_runs_that_do_not_belong_together_is_an_error(
    probes: list[Probe], requests: list[int], why: str
) -> None:
    with pytest.raises(ValueError, match=why):
        pooled(probes, requests)
