"""``pd-orchestrator bench`` end to end, and the report's pieces."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from rich.console import Console

from pd_orchestrator.bench.report import PLOTS, quantiles, summary_table
from pd_orchestrator.bench.results import RequestRecord, RunResult, Slo, percentile, summarize
from pd_orchestrator.children import python_command
from tests.conftest import SimFactory

ROOT = Path(__file__).resolve().parents[2]


def _bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        python_command("bench", *args),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        check=False,
    )


def test_virtual_bench_writes_table_json_and_plots(tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = _bench(
        "--workload", "shared-prefix", "--virtual", "--fleet", "tiny", "--requests", "30",
        "--policies", "always-pd,decode-only,static-0.5", "--out", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "always-pd" in result.stdout and "TTFT p50" in result.stdout
    document = json.loads((out / "results.json").read_text())
    assert document["settings"]["runner"] == "virtual"
    rows = {row["strategy"]: row for row in document["strategies"]}
    assert set(rows) == {"always-pd", "decode-only", "static-0.5"}
    assert rows["always-pd"]["decisions"] == {"pd": 30}
    assert rows["decode-only"]["kv_bytes"] == 0
    assert len(rows["static-0.5"]["quantiles"]["ttft"]) == 101
    assert all((out / name).stat().st_size > 1000 for name in PLOTS)
    assert (out / "attainment.png").stat().st_size > 1000
    goodput = document["goodput"]
    assert goodput["attainment_goal"] == 0.9 and set(goodput["strategies"]) == set(rows)
    for found in goodput["strategies"].values():
        probes = found["probes"]
        assert 2 <= len(probes) <= 12 and found["multiplier"] >= 0.0
        passing = [p["multiplier"] for p in probes if p["attainment"] >= 0.9]
        assert found["multiplier"] == max(passing, default=0.0)
    assert "vs best other" in result.stdout


def test_bench_rejects_bad_arguments(tmp_path: Path) -> None:
    unknown = _bench("--workload", "long-doc", "--virtual", "--policies", "nope")
    assert unknown.returncode == 2 and "unknown strategy 'nope'" in unknown.stdout
    missing = _bench("--workload", "mooncake", "--virtual", "--trace", str(tmp_path / "none"))
    assert missing.returncode == 2 and "error" in missing.stdout


def _probes(out: Path) -> dict[str, dict[float, dict[str, float]]]:
    strategies = json.loads((out / "results.json").read_text())["goodput"]["strategies"]
    return {
        name: {probe["multiplier"]: probe for probe in found["probes"]}
        for name, found in strategies.items()
    }


def test_seeds_pool_each_probe_over_the_workloads_draws(tmp_path: Path) -> None:
    common = (
        "--workload", "shared-prefix", "--virtual", "--fleet", "tiny", "--requests", "32",
        "--policies", "always-pd,goodput", "--bisections", "1", "--attainment", "0.95",
        "--no-plots",
    )  # fmt: skip
    runs = {}
    for name, extra in (("seed0", ()), ("seed1", ("--seed", "1")), ("both", ("--seeds", "2"))):
        result = _bench(*common, *extra, "--out", str(tmp_path / name))
        assert result.returncode == 0, result.stderr
        runs[name] = _probes(tmp_path / name)
    document = json.loads((tmp_path / "both" / "results.json").read_text())
    assert document["settings"]["seeds"] == 2
    differ = 0
    for strategy, probes in runs["both"].items():
        for multiplier, probe in probes.items():
            one = runs["seed0"][strategy].get(multiplier)
            two = runs["seed1"][strategy].get(multiplier)
            if one is None or two is None:
                continue  # the pooled search walked where neither draw's did
            # the same number of requests per draw: the pooled share is their mean
            assert probe["attainment"] == pytest.approx((one["attainment"] + two["attainment"]) / 2)
            assert probe["runs"] == 2 and one["runs"] == 1
            differ += one["attainment"] != two["attainment"]
    assert differ, "the two draws should differ somewhere, or pooling says nothing"


def test_seeds_are_refused_where_they_cannot_pool(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_text(
        '{"timestamp": 0, "input_length": 600, "output_length": 8, "hash_ids": [1, 2]}\n'
    )
    # a one-line trace has no second window to draw
    short = _bench("--workload", "mooncake", "--virtual", "--trace", str(trace), "--requests",
                   "1", "--seeds", "2")  # fmt: skip
    assert short.returncode == 2 and "ends before seed 1's window" in short.stdout
    # a trace that repeats itself draws the same window twice
    trace.write_text(trace.read_text() * 2)
    same = _bench("--workload", "mooncake", "--virtual", "--trace", str(trace), "--requests",
                  "1", "--seeds", "2")  # fmt: skip
    assert same.returncode == 2 and "draw the same mooncake requests" in same.stdout
    live = _bench("--workload", "long-doc", "--seeds", "2")
    assert live.returncode == 2 and "--virtual" in live.stdout
    none = _bench("--workload", "long-doc", "--virtual", "--seeds", "0")
    assert none.returncode == 2 and "at least 1" in none.stdout


def test_live_bench_against_a_target(sim_factory: SimFactory, tmp_path: Path) -> None:
    sim = sim_factory("--profile", "instant", "--model", "meta-llama/Llama-3.1-8B-Instruct")
    out = tmp_path / "live"
    result = _bench(
        "--workload", "multi-turn", "--requests", "6", "--time-scale", "0.01",
        "--target", sim.url, "--metrics-url", sim.url, "--out", str(out), "--no-plots",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    (row,) = json.loads((out / "results.json").read_text())["strategies"]
    assert row["completed"] == 6 and row["errors"] == 0
    assert row["prefill_tokens"] > 0


def _record(index: int, ttft: float, tpot: float, decision: str) -> RequestRecord:
    return RequestRecord(index, f"s{index}", float(index), 100, decision, "d", None, 10, 0,
                         ttft, ttft + 9 * tpot, tpot)  # fmt: skip


def test_summary_goodput_and_table() -> None:
    records = [_record(0, 0.1, 0.01, "decode"), _record(1, 3.0, 0.01, "pd")]
    records.append(RequestRecord(2, "s2", 2.0, 100, error="boom"))
    result = RunResult("x", "decode-first", "w", "f", "virtual", records)
    summary = summarize(result, Slo(ttft=2.0, tpot=0.05))
    assert summary.completed == 2 and summary.errors == 1
    assert summary.slo_share == 1 / 3
    assert summary.decisions == {"decode": 1, "pd": 1}
    assert summary.goodput == 1 / result.span
    console = Console(width=200, record=True)
    console.print(summary_table([summary], "title", Slo()))
    assert "decode / pd" in console.export_text()


def test_percentiles_and_quantiles() -> None:
    assert percentile([], 50) is None
    assert percentile([1.0, 3.0], 50) == 2.0
    points = quantiles([float(v) for v in range(11)])
    assert points is not None and points[0] == 0.0 and points[100] == 10.0
    assert quantiles([]) is None
