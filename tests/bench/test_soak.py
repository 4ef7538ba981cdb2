"""The soak's pure parts: the mix, the fault schedule, the verdicts, the growth check
and the report."""

from __future__ import annotations

import io
import random

import pytest
from rich.console import Console

from pd_orchestrator.bench.soak import (
    FAULTS,
    Reading,
    SoakOptions,
    SoakResult,
    Tally,
    _reference_body,
    fault_times,
    growth,
    judge_run,
    make_job,
    preemption_round,
    render,
    verdict_table,
    windows,
)
from pd_orchestrator.bench.verdicts import (
    CLEAN_ERROR,
    DUPLICATED,
    IDENTICAL,
    LEFT,
    LOST,
    Answer,
    Job,
    judge_job,
)
from pd_orchestrator.cli.main import build_parser, main

MiB = 2**20
EXPECTED = [5, 6, 7, 8]
ERROR = {"error": {"message": "decoder unavailable", "type": "ServiceUnavailable", "code": 503}}


def _job(n: int = 1, leave: int | None = None) -> Job:
    return Job("completion", {"prompt": "p", "stream": True, "n": n}, leave)


def _answer(by_index: dict[int, list[int]], **fields: object) -> Answer:
    answer = Answer(200, **fields)  # type: ignore[arg-type]
    for index, tokens in by_index.items():
        answer.by_index[index] = list(tokens)
        answer.tokens += tokens
        answer.finishes_by_index[index] = ["length"]
        answer.finishes.append("length")
    return answer


def test_every_choice_of_an_n_answer_is_judged_and_the_worst_counts() -> None:
    assert judge_job(_job(2), _answer({0: EXPECTED, 1: EXPECTED}), EXPECTED) == IDENTICAL
    assert judge_job(_job(2), _answer({0: EXPECTED, 1: EXPECTED[:3]}), EXPECTED) == LOST
    assert judge_job(_job(2), _answer({0: EXPECTED, 1: [*EXPECTED, 9]}), EXPECTED) == DUPLICATED
    assert judge_job(_job(2), _answer({0: EXPECTED}), EXPECTED) == LOST  # a choice missing
    outside = _answer({0: EXPECTED, 1: EXPECTED, 7: EXPECTED})
    assert judge_job(_job(2), outside, EXPECTED) == LOST


def test_a_client_that_leaves_must_have_had_a_prefix() -> None:
    job = _job(leave=2)
    assert judge_job(job, Answer(200, tokens=[5, 6], done=False, left=True), EXPECTED) == LEFT
    assert judge_job(job, Answer(200, tokens=[5, 7], done=False, left=True), EXPECTED) == LOST


def test_clean_errors_and_cut_streams() -> None:
    assert judge_job(_job(), Answer(503, error=ERROR), EXPECTED) == CLEAN_ERROR
    cut = Answer(200, tokens=[5, 6], done=False)
    assert judge_job(_job(), cut, EXPECTED) == LOST
    assert judge_job(_job(), Answer(500, error="Internal Server Error"), EXPECTED) == LOST


def test_an_http_500_in_the_openai_shape_is_not_a_clean_error() -> None:
    tally = Tally()
    inner = {"message": "internal error: TypeError", "type": "InternalServerError", "code": 500}
    tally.add(_job(), Answer(500, error={"error": inner}), EXPECTED)
    tally.add(_job(), Answer(503, error=ERROR), EXPECTED)
    assert tally.verdicts[CLEAN_ERROR] == 2 and tally.unclean == 1
    assert dict(tally.errors) == {"500 InternalServerError": 1, "503 ServiceUnavailable": 1}
    checks = dict((name, ok) for name, ok, _ in judge_run(SoakResult(tally, []), SoakOptions()))
    assert checks["every error clean (no HTTP 500)"] is False


def test_the_flatness_windows_take_a_median_each() -> None:
    readings = _readings([1] * 13, [30, 30, 30, 90, 30, 30, 30, 30, 30, 30, 60, 31, 31], 60.0)
    pair = windows(readings, 120.0, 180.0)
    assert pair is not None
    first, last = pair
    assert [r.at for r in first] == [120.0, 180.0, 240.0]
    assert [r.at for r in last] == [540.0, 600.0, 660.0, 720.0]
    result = SoakResult(_passing_tally(), readings)
    checks = _checks_with(result, SoakOptions(flat_after=120.0, flat_window=180.0))
    assert checks["descriptors flat"]  # one busy reading in each window does not count
    assert windows(readings, 120.0, 400.0) is None  # the windows do not fit apart


def test_growth() -> None:
    assert growth(100, 104) == 0.04
    assert growth(100, 90) == -0.1
    assert growth(0, 10) == 0.0


def _readings(rss: list[int], fds: list[int], every: float = 300.0) -> list[Reading]:
    return [
        Reading(i * every, r * MiB, f, 0.01) for i, (r, f) in enumerate(zip(rss, fds, strict=True))
    ]


def _checks(result: SoakResult) -> dict[str, bool]:
    return _checks_with(result, SoakOptions())


def _checks_with(result: SoakResult, options: SoakOptions) -> dict[str, bool]:
    return {name: ok for name, ok, _ in judge_run(result, options)}


def _passing_tally() -> Tally:
    tally = Tally()
    tally.add(_job(), _answer({0: EXPECTED}), EXPECTED)
    return tally


def test_flatness_is_measured_from_the_ten_minute_readings() -> None:
    # +50% in the first ten minutes (warm-up) does not count; +3% after does not fail
    flat = _readings([60, 90, 100, 102, 104], [20, 40, 50, 51, 52])
    checks = _checks(SoakResult(_passing_tally(), flat, fds_before=20, fds_after=20))
    assert checks["RSS flat"] and checks["descriptors flat"]
    assert all(checks.values())
    growing = _readings([60, 90, 100, 106, 110], [20, 40, 50, 50, 60])
    checks = _checks(SoakResult(_passing_tally(), growing))
    assert not checks["RSS flat"] and not checks["descriptors flat"]


def test_a_short_run_is_held_to_its_descriptors_coming_back() -> None:
    short = _readings([60, 61], [20, 30], every=60.0)
    checks = _checks(SoakResult(_passing_tally(), short, fds_before=20, fds_after=27))
    assert "RSS flat" not in checks and checks["descriptors back after the load"]
    assert all(checks.values())
    checks = _checks(SoakResult(_passing_tally(), short, fds_before=20, fds_after=40))
    assert not checks["descriptors back after the load"]


def test_lost_duplicated_or_a_dead_gateway_fail_the_run() -> None:
    tally = _passing_tally()
    tally.add(_job(), Answer(200, tokens=[5], done=False), EXPECTED)
    result = SoakResult(tally, [], alive=False)
    checks = _checks(result)
    assert not checks["0 lost"] and not checks["gateway alive"] and checks["0 duplicated"]
    result.checks = judge_run(result, SoakOptions())
    assert not result.passed


def test_the_report_shows_every_figure() -> None:
    tally = _passing_tally()
    tally.add(_job(), Answer(503, error=ERROR), EXPECTED)
    tally.ttft += [0.1, 0.2]
    readings = [Reading(10.0, 64 * MiB, 33, 0.02, 4.0)]
    console = Console(file=io.StringIO(), width=140)
    console.print(render(tally, readings, 600.0))
    console.print(verdict_table(judge_run(SoakResult(tally, readings), SoakOptions())))
    text = console.file.getvalue()  # type: ignore[attr-defined]
    for expected in ("soak at 10.0 min", "503 ServiceUnavailable: 1", "64.0", "33", "pass"):
        assert expected in text, expected


def test_the_mix_has_every_shape_and_is_seeded() -> None:
    jobs = [make_job(i, "run", 24, random.Random(0)) for i in range(24)]
    bodies = [job.body for job in jobs]
    assert any("response_format" in b for b in bodies)
    assert any("tool_choice" in b for b in bodies)
    assert {b.get("n") for b in bodies} >= {2, 3}
    assert any(job.leave_after for job in jobs)
    assert {job.kind for job in jobs} == {"chat", "completion"}
    assert {job.stream for job in jobs} == {True, False}
    warm = [job for job in jobs if job.body["max_tokens"] > 24]
    cold = [job.body.get("messages") for job in jobs if job.body["max_tokens"] == 24]
    assert len(warm) == 6 and all(job.body["messages"] in cold for job in warm)
    again = [make_job(i, "run", 24, random.Random(0)).body for i in range(24)]
    assert again == bodies


def test_a_preemption_round_overflows_the_pressured_decoder_after_warming_it() -> None:
    warm, jobs = preemption_round(0, "run")
    assert len(warm) == len(jobs) == 4
    blocks = sum(-(-(len(j.body["prompt"]) + j.body["max_tokens"]) // 16) for j in jobs)
    assert blocks > 64  # the pressured decoder's blocks
    assert {j.stream for j in jobs} == {True, False}
    for before, job in zip(warm, jobs, strict=True):
        assert before.body["prompt"] == job.body["prompt"] and before.body["max_tokens"] == 1
        assert job.body["cache_hit_threshold"] == 0.9 and job.body["ignore_eos"]
    again, _ = preemption_round(0, "run")
    assert again == warm and preemption_round(1, "run")[0] != warm  # seeded, new each round
    # the reference (a cold cache) is asked without the threshold
    assert "cache_hit_threshold" not in _reference_body(jobs[0])
    kinds = [action.split()[0] for _, action in FAULTS]
    assert kinds.index("kill") < kinds.index("preempt") < kinds.index("restart")


def test_the_faults_repeat_each_period_within_the_run() -> None:
    times = list(fault_times(150.0, 60.0))
    assert len(times) == 2 * len(FAULTS) + sum(1 for at, _ in FAULTS if at < 30.0)
    assert times[len(FAULTS)] == (60.0 + FAULTS[0][0], FAULTS[0][1])
    assert all(at < 150.0 for at, _ in times)


def test_the_command_line_takes_duration_and_rate_and_refuses_nonsense(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = build_parser().parse_args(["soak", "--duration", "180", "--rate", "7.5"])
    assert (args.duration, args.rate, args.concurrency) == (180.0, 7.5, SoakOptions().concurrency)
    assert main(["soak", "--rate", "0"]) == 2
    assert "rate" in capsys.readouterr().err
    with pytest.raises(ValueError, match="concurrency"):
        SoakOptions(concurrency=0)
