"""``benchmarks/instructions.py`` and ``benchmarks/decision_bench.py``: the counts'
arithmetic, the commands they count, and the decision over a fleet of a given size
(valgrind itself is not run here)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from pd_orchestrator.config.loader import parse_config
from tests.bench.scripts import BENCHMARKS, benchmark_script


@pytest.fixture(scope="module")
def counts() -> Iterator[ModuleType]:
    with benchmark_script("instructions") as module:
        yield module


@pytest.fixture(scope="module")
def decision() -> Iterator[ModuleType]:
    with benchmark_script("decision_bench") as module:
        yield module


def test_one_more_request_is_the_difference_of_the_two_counts(counts: ModuleType) -> None:
    run = counts.Run
    found = {run("gateway", "whole", 400): 5_000_000, run("gateway", "whole", 1600): 8_600_000}
    assert counts.per_request(found, "gateway", "whole", 400) == 3_000.0


def test_the_counted_commands(counts: ModuleType, tmp_path: Path) -> None:
    run = counts.Run
    argv = run("gateway", "stream", 400).argv(None)
    assert argv[:3] == ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null"]
    assert argv[4:] == [
        str(BENCHMARKS / "request_path.py"), "--target", "gateway", "--requests", "400", "--stream",
    ]  # fmt: skip
    before = run("gateway-baseline", "whole", 1600).argv(tmp_path)
    assert before[3] == str(tmp_path / ".venv" / "bin" / "python")
    assert before[4:] == [
        str(tmp_path / "benchmarks" / "request_path.py"), "--target", "gateway",
        "--requests", "1600",
    ]  # fmt: skip
    decided = run("decision-baseline", "16:8", 400).argv(tmp_path)
    assert decided[3] == str(tmp_path / ".venv" / "bin" / "python")
    assert decided[4:] == [
        str(BENCHMARKS / "decision_bench.py"), "--decoders", "16", "--prefillers", "8",
        "--requests", "400",
    ]  # fmt: skip


def test_a_compiled_target_runs_this_checkout_with_the_build_first_on_the_path(
    counts: ModuleType, tmp_path: Path
) -> None:
    run = counts.Run
    argv = run("gateway-compiled", "whole", 400).argv(None, tmp_path)
    assert argv[:2] == ["env", f"PYTHONPATH={tmp_path.resolve()}"]
    assert argv[2:5] == ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null"]
    assert argv[6:] == [
        str(BENCHMARKS / "request_path.py"), "--target", "gateway", "--requests", "400",
    ]  # fmt: skip
    decided = run("decision-compiled", "1:1", 400).argv(None, tmp_path)
    assert decided[1] == f"PYTHONPATH={tmp_path.resolve()}"
    assert decided[6] == str(BENCHMARKS / "decision_bench.py")
    (tmp_path / "pd_orchestrator").mkdir()
    args = counts.parse_args(["--targets", "gateway", "--compiled", str(tmp_path)])
    assert args.targets == ["gateway", "gateway-compiled"]
    with pytest.raises(SystemExit):  # no build there
        counts.parse_args(["--compiled", str(tmp_path / "none")])


def test_the_table_sets_every_target_against_the_first(counts: ModuleType) -> None:
    figures = {("gateway", "whole"): 800_000.0, ("floor-decode", "whole"): 200_000.0}
    lines = counts.table(figures, ["gateway", "floor-decode"], ["whole"]).splitlines()
    assert lines[2] == "| gateway | 800,000 | 1.000x |"
    assert lines[3] == "| floor-decode | 200,000 | 0.250x |"


def test_the_arguments(counts: ModuleType) -> None:
    args = counts.parse_args(["--targets", "gateway,floor-plan", "--fleets", "1:1,16:8"])
    assert args.targets == ["gateway", "floor-plan"] and args.fleets == ["1:1", "16:8"]
    for bad in (["--fleets", "0:1"], ["--fleets", "16"], ["--targets", "smg"]):
        with pytest.raises(SystemExit):
            counts.parse_args(bad)


def test_the_decision_is_made_over_the_whole_fleet(decision: ModuleType) -> None:
    decide = decision.floor_relay.Planned(parse_config(decision.fleet_config(6, 3)))
    assert len(decide.state.fleet.endpoints()) == 9
    scope = {"path": "/v1/completions", "headers": []}
    bodies = [decision.overhead_bench.request_body(False, f"hello {i}") for i in range(12)]
    picked = {decide.decide(scope, body.encode())[2][1].decoder.name for body in bodies}
    assert picked <= {f"decode-{i}" for i in range(6)} and len(picked) > 1  # prompts spread


def test_the_decision_bench_runs(decision: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    assert decision.main(["--decoders", "4", "--prefillers", "2", "--requests", "20"]) == 0
    assert "decision over 4:2: 20 requests" in capsys.readouterr().out
