"""The client-side timing a flow reports to the threshold policies and metrics."""

from __future__ import annotations

import pytest

from pd_orchestrator.flows.render import _Timing


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_stream_reports_the_mean_gap_after_its_first_chunk() -> None:
    clock = _Clock()
    timing = _Timing(0.0, clock)
    clock.now = 0.5
    timing.content()
    clock.now = 0.6
    timing.content()
    clock.now = 0.9
    timing.content(2)  # two chunks read together
    assert timing.ttft == pytest.approx(0.5)
    assert timing.itl == pytest.approx(0.4 / 3)


@pytest.mark.parametrize("chunks", [1, 40])
def test_content_written_at_once_has_no_itl_rather_than_zero(chunks: int) -> None:
    clock = _Clock()
    timing = _Timing(0.0, clock)
    clock.now = 2.0
    timing.content(chunks)
    assert timing.ttft == pytest.approx(2.0)
    assert timing.itl is None
