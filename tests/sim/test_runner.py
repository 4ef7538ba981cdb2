"""The step loop's pacing: the loop's own overhead is taken out of the next step."""

from __future__ import annotations

import anyio

from pd_orchestrator.sim.engine import StepResult
from pd_orchestrator.sim.runner import EngineRunner

from .helpers import make_engine


def _pace(runner: EngineRunner, duration: float, now: float, target: float | None) -> float:
    """The schedule after a step of ``duration`` begun at ``now`` (the clock is past it:
    no sleep)."""
    result = StepResult(duration, (), progressed=True)
    paced = anyio.run(runner._pace, result, now, target)
    assert paced is not None
    return paced


def test_a_step_on_schedule_ends_one_duration_after_the_previous_one() -> None:
    """3 ms of the loop's own work between two 10 ms steps: the second still ends 10 ms
    after the first, not 13."""
    runner = EngineRunner(make_engine(), clock=lambda: 5.0)
    assert _pace(runner, 0.010, now=1.003, target=1.0) == 1.010


def test_a_loop_behind_by_more_than_max_lag_starts_the_schedule_again() -> None:
    runner = EngineRunner(make_engine(), clock=lambda: 5.0, max_lag=0.05)
    assert _pace(runner, 0.010, now=1.2, target=1.0) == 1.21
    assert _pace(runner, 0.010, now=1.0, target=None) == 1.01


def test_time_scale_stretches_the_step() -> None:
    runner = EngineRunner(make_engine(), time_scale=2.0, clock=lambda: 5.0)
    assert _pace(runner, 0.010, now=1.001, target=1.0) == 1.02
