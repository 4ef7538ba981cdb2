"""Helpers shared by the benchmark scripts."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.table import Table

from pd_orchestrator.bench.loadgen import Summary
from pd_orchestrator.children import Child, python_command, start_child, stop_child

console = Console(width=160)


@contextmanager
def sim(*args: str, name: str = "sim") -> Iterator[Child]:
    child = start_child(name, python_command("sim", "--port", "0", *args))
    try:
        yield child
    finally:
        stop_child(child)


def ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.2f}"


def summary_table(title: str, rows: list[tuple[str, Summary]]) -> Table:
    table = Table(title=title)
    for column in ("target", "requests", "errors", "req/s", "p50 ms", "p99 ms", "ttft p50 ms"):
        table.add_column(column, justify="right")
    for name, s in rows:
        table.add_row(
            name, str(s.count), str(s.errors), f"{s.rps:.0f}", ms(s.p50), ms(s.p99), ms(s.ttft_p50)
        )
    return table
