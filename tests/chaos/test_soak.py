"""The soak for three minutes: the hour's mix and faults, its criteria but the flatness
window (too short a run: the gateway's descriptors must come back within a few of the
reading before the load once the load stops)."""

from __future__ import annotations

import io
import os

import pytest
from rich.console import Console

from pd_orchestrator.bench.soak import SoakOptions, run_soak
from pd_orchestrator.bench.verdicts import DUPLICATED, HUNG, IDENTICAL, LEFT, LOST

SECONDS = float(os.environ.get("PDO_SOAK_SECONDS", "180"))


@pytest.mark.timeout(int(SECONDS) + 420)
def test_three_minutes_of_soak_lose_nothing_and_leak_no_descriptor() -> None:
    options = SoakOptions(duration=SECONDS, rate=10.0, concurrency=12, report_every=60.0)
    console = Console(file=io.StringIO(), width=120)
    result = run_soak(options, console)
    report = console.file.getvalue()  # type: ignore[attr-defined]
    print(report)
    verdicts = result.tally.verdicts
    assert (verdicts[LOST], verdicts[DUPLICATED], verdicts[HUNG]) == (0, 0, 0), report
    assert result.tally.unclean == 0, report
    assert verdicts[IDENTICAL] > 0 and verdicts[LEFT] > 0, report
    assert result.readings[-1].recovered > 0, report  # the breaking decoder's answers
    assert result.readings[-1].handbacks > 0, report  # the preemption rounds
    assert any(name == "descriptors back after the load" for name, _, _ in result.checks)
    assert result.passed, report
