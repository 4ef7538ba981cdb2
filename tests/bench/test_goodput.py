"""The goodput search: the highest rate multiple meeting the attainment goal."""

from __future__ import annotations

import pytest

from pd_orchestrator.bench.fleet import preset_fleet
from pd_orchestrator.bench.goodput import (
    GoodputSearch,
    Probe,
    SearchSettings,
    pooled,
    scaled,
    search,
)
from pd_orchestrator.bench.report import (
    goodput_document,
    goodput_table,
    ratios_to_best_other,
    void_reason,
)
from pd_orchestrator.bench.results import RequestRecord, Slo
from pd_orchestrator.bench.workloads import WorkloadOptions, build_workload
from pd_orchestrator.model.hardware import get_profile


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


def _search(multiplier: float) -> GoodputSearch:
    probe = Probe(multiplier, 0.95, 1.0, {}) if multiplier else None
    return GoodputSearch(multiplier, probe, (probe,) if probe else ())


@pytest.mark.parametrize(
    ("found", "reason"),
    [
        ({"a": 0.0, "b": 0.0}, "void: every strategy at the floor"),
        ({"a": 64.0, "b": 64.0}, "void: every strategy at the ceiling"),
        ({"a": 0.0, "b": 64.0}, None),
        ({"a": 64.0, "b": 32.0}, None),
    ],
)
def test_a_row_at_the_floor_or_the_ceiling_is_void(
    found: dict[str, float], reason: str | None
) -> None:
    searches = {name: _search(m) for name, m in found.items()}
    assert void_reason(searches, 64.0) == reason
    document = goodput_document(searches, 0.9, ceiling=64.0)
    assert document["void"] == reason
    ratios = [s["ratio_to_best_other"] for s in document["strategies"].values()]
    assert (ratios == [None, None]) == (reason is not None)
    table = goodput_table(searches, "row", Slo(), 0.9, ceiling=64.0)
    assert (reason is not None) == ("not counted" in str(table.title))
    if reason:
        assert list(table.columns[3].cells) == ["-", "-"]


def test_a_ttft_limit_scales_with_the_prompt_over_a_floor() -> None:
    h200 = get_profile("h200-llama3-8b")
    slo = Slo(1.0, 0.03, ttft_scale=3.0, prefill=h200)
    short, long = 2000, 60000
    assert slo.ttft_limit(short) == 1.0  # a short prompt gets the floor
    assert slo.ttft_limit(long) == pytest.approx(3 * h200.prefill_seconds(long, 0))
    assert slo.ttft_limit(long) > 1.0
    assert Slo(1.0, 0.03).ttft_limit(long) == 1.0  # the absolute SLO is unchanged
    late = RequestRecord(0, "s", 0.0, long, ttft=2.0, e2e=3.0, tpot=0.02)
    assert late.meets(slo) and not late.meets(Slo(1.0, 0.03))
    assert "3 x prefill alone on h200-llama3-8b" in slo.describe()
    with pytest.raises(ValueError, match="prefill profile"):
        Slo(1.0, 0.03, ttft_scale=3.0)


def test_the_slo_uses_the_fleets_fastest_prefill_hardware() -> None:
    mixed = preset_fleet("mixed")
    fastest = mixed.prefill_latency()
    for instance in mixed.prefillers:
        assert fastest.prefill_seconds(8192, 0) <= instance.latency.prefill_seconds(8192, 0)
