"""Shared fixtures: the anyio backend and simulator processes on loopback."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import pytest

from pd_orchestrator.children import Child, python_command, start_child, stop_child

SimFactory = Callable[..., Child]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@contextlib.contextmanager
def _sims() -> Iterator[SimFactory]:
    children: list[Child] = []

    def start(*args: str, name: str = "sim") -> Child:
        argv = python_command("sim", "--host", "127.0.0.1", "--port", "0", *args)
        child = start_child(name, argv, timeout=30)
        children.append(child)
        return child

    try:
        yield start
    finally:
        for child in children:
            stop_child(child)


@pytest.fixture
def sim_factory() -> Iterator[SimFactory]:
    """Start ``pd-orchestrator sim`` processes on free loopback ports; stop them after."""
    with _sims() as start:
        yield start


@pytest.fixture(scope="module")
def module_sims() -> Iterator[SimFactory]:
    """Like ``sim_factory``, shared by the tests of one module."""
    with _sims() as start:
        yield start
