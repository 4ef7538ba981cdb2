"""The pure packages stay pure when loaded: importing the planner, the policies,
routing, ``openai``, the ground floor or the simulator's engine loads no HTTP stack,
event loop library, message queue or tracing. The static contract is ``make lint``'s
import-linter run (it also forbids importing ``asyncio``, ``socket`` and ``threading``,
which the interpreter itself may load); this checks what an import really pulls in,
``__init__`` modules included."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

HEAVY = (
    "httpx", "httptools", "h11", "uvicorn", "uvloop", "starlette", "anyio", "zmq",
    "opentelemetry",
)  # fmt: skip

CHECK = """
import importlib, sys
importlib.import_module({module!r})
loaded = sorted(m for m in {heavy!r} if m in sys.modules)
assert not loaded, loaded
"""


@pytest.mark.parametrize(
    "module",
    [
        "pd_orchestrator.model",
        "pd_orchestrator.model.load",
        "pd_orchestrator.config",
        "pd_orchestrator.openai",
        "pd_orchestrator.routing",
        "pd_orchestrator.policies",
        "pd_orchestrator.policies.plugins",
        "pd_orchestrator.planner",
        "pd_orchestrator.sim.engine",
        "connectors",
    ],
)
def test_a_pure_package_loads_no_http_stack(module: str) -> None:
    code = CHECK.format(module=module, heavy=HEAVY)
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr[-2000:]


def test_the_gateway_does_load_it() -> None:
    """The check can fail: the gateway is where the HTTP stack lives."""
    code = CHECK.format(module="pd_orchestrator.gateway.app", heavy=HEAVY)
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode != 0 and "AssertionError" in result.stderr


def test_the_static_contract_names_the_pure_packages_and_what_they_may_not_import() -> None:
    """``make lint``'s import-linter contract covers ``openai`` and forbids the event
    loop, sockets, threads and tracing to the pure packages; the vLLM plugin may not
    import ``connectors`` either."""
    config = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    contracts = {c["name"]: c for c in config["tool"]["importlinter"]["contracts"]}
    pure = next(c for name, c in contracts.items() if name.startswith("Pure packages"))
    assert {"pd_orchestrator.openai", "pd_orchestrator.planner", "connectors"} <= set(
        pure["source_modules"]
    )
    assert {"asyncio", "socket", "threading", "opentelemetry"} <= set(pure["forbidden_modules"])
    plugin = next(c for name, c in contracts.items() if "vLLM" in name)
    assert "connectors" in plugin["forbidden_modules"]
