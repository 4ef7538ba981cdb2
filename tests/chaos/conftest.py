"""Fixtures of the chaos suite, its time limits, and its report at the end of the run."""

from __future__ import annotations

from pathlib import Path

import pytest

from pd_orchestrator.children import Child

from ..conftest import SimFactory
from .harness import MODEL, REPORT

HERE = Path(__file__).parent
TIMEOUT = 240
"""Seconds per test: five or six processes start and stop in each, on a busy machine."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in item.path.parents and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(TIMEOUT))


@pytest.fixture(scope="module")
def reference(module_sims: SimFactory) -> Child:
    """The reference instance: a single simulator the faults never touch."""
    return module_sims("--profile", "instant", "--model", MODEL, name="reference")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not REPORT:
        return
    terminalreporter.section("chaos: per fault")
    for tally in REPORT:
        terminalreporter.write_line(tally.line())
