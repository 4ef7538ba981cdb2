"""Shared fixtures: the anyio backend and simulator processes on loopback."""

from __future__ import annotations

import contextlib
import importlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, settings

from pd_orchestrator.children import Child, python_command, start_child, stop_child

SimFactory = Callable[..., Child]

# CI shares a 2-core machine with other work: no property test may fail for being slow.
settings.register_profile(
    "shared-machine",
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
settings.load_profile("shared-machine")

COMPILED_PROBES = (
    "pd_orchestrator.planner.plan",
    "pd_orchestrator.flows.chunks",
    "pd_orchestrator.upstream.transport",
    "pd_orchestrator.gateway.protocol",
)
"""Modules that ``setup.py`` compiles: under ``PDO_EXPECT_COMPILED=1`` (``make
test-compiled``) each must load as a C extension, or the run would test the source."""


def pytest_sessionstart(session: pytest.Session) -> None:
    """Refuse a compiled run (``PDO_EXPECT_COMPILED=1``) that would import the source."""
    if os.environ.get("PDO_EXPECT_COMPILED") != "1":
        return
    for name in COMPILED_PROBES:
        path = importlib.import_module(name).__file__ or ""
        if not path.endswith(".so"):
            raise pytest.UsageError(f"PDO_EXPECT_COMPILED=1 but {name} loads from {path}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On the compiled build, skip the tests marked ``source_only``: a compiled class's
    methods cannot be patched, so such a test runs on the source (``make unit``)."""
    if os.environ.get("PDO_EXPECT_COMPILED") != "1":
        return
    skip = pytest.mark.skip(reason="patches a compiled class: run on the source")
    for item in items:
        if item.get_closest_marker("source_only") is not None:
            item.add_marker(skip)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@contextlib.contextmanager
def _children(make_argv: Callable[..., tuple[str, list[str]]]) -> Iterator[Callable[..., Child]]:
    """A factory of children (made by ``make_argv``) stopped when the block ends."""
    children: list[Child] = []

    def start(*args: Any, **kwargs: Any) -> Child:
        name, argv = make_argv(len(children), *args, **kwargs)
        child = start_child(name, argv, timeout=60)  # a busy machine starts slowly
        children.append(child)
        return child

    try:
        yield start
    finally:
        for child in children:
            stop_child(child)


def _sim_argv(index: int, *args: str, name: str = "sim") -> tuple[str, list[str]]:
    return name, python_command("sim", "--host", "127.0.0.1", "--port", "0", *args)


def _sims() -> contextlib.AbstractContextManager[SimFactory]:
    return _children(_sim_argv)


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


GatewayFactory = Callable[..., Child]


def _gateways(directory: Path) -> contextlib.AbstractContextManager[GatewayFactory]:
    def argv(index: int, config: dict[str, Any], name: str = "gateway") -> tuple[str, list[str]]:
        path = directory / f"{name}-{index}.yaml"
        path.write_text(yaml.safe_dump(config))
        return name, python_command("serve", "--config", str(path), "--port", "0")

    return _children(argv)


@pytest.fixture
def gateway_factory(tmp_path: Path) -> Iterator[GatewayFactory]:
    """Start ``pd-orchestrator serve`` on a config dict; stop it after the test."""
    with _gateways(tmp_path) as start:
        yield start


@pytest.fixture(scope="module")
def module_gateways(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayFactory]:
    with _gateways(tmp_path_factory.mktemp("gateways")) as start:
        yield start


def gateway_config(
    decoders: list[Child],
    prefillers: list[Child],
    **overrides: Any,
) -> dict[str, Any]:
    """A gateway config dict over running simulators (model: the instant profile's)."""
    config: dict[str, Any] = {
        "decoders": [
            {"name": f"decode-{i}", "url": c.url, "hardware": "h200", "model": "sim-model"}
            for i, c in enumerate(decoders)
        ],
        "prefillers": [
            {"name": f"prefill-{i}", "url": c.url, "hardware": "h200", "model": "sim-model"}
            for i, c in enumerate(prefillers)
        ],
        "health": {"interval": 0.5},
    }
    config.update(overrides)
    return config
