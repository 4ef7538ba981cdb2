"""The compiled build (setup.py, ``make compiled``): what it compiles, that a plain
build compiles nothing, and that ``make test`` runs the request path's tests on it.
The build itself runs in ``make test-compiled``, whose run refuses to start when the
modules load from the source (tests/conftest.py)."""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _setup() -> ModuleType:
    spec = importlib.util.spec_from_file_location("pdo_setup", ROOT / "setup.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # not __main__: setup() is not called
    return module


def test_every_compiled_module_is_a_module_of_the_package() -> None:
    compiled = _setup().COMPILED
    assert compiled and len(set(compiled)) == len(compiled)
    for path in compiled:
        assert path.startswith("pd_orchestrator/") and (ROOT / path).is_file(), path


def _awaiting_finally(source: str) -> list[int]:
    """The lines of the ``try`` statements whose ``finally`` block awaits."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Try | ast.TryStar) and node.finalbody:
            inner = (sub for stmt in node.finalbody for sub in ast.walk(stmt))
            if any(isinstance(sub, ast.Await | ast.AsyncWith | ast.AsyncFor) for sub in inner):
                found.append(node.lineno)
    return found


def test_no_compiled_module_awaits_in_a_finally_block() -> None:
    """Compiled, such a block raised again an exception handled before it (setup.py)."""
    for path in _setup().COMPILED:
        assert _awaiting_finally((ROOT / path).read_text()) == [], path


def test_an_awaiting_finally_block_is_found() -> None:
    source = """
async def f(x):
    try:
        await x.a()
    finally:
        await x.close()
    try:
        pass
    finally:
        x.done()
"""
    assert _awaiting_finally(source) == [3]


def test_a_plain_build_compiles_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PDO_COMPILE", raising=False)
    assert _setup().ext_modules() == []
    monkeypatch.setenv("PDO_COMPILE", "0")
    assert _setup().ext_modules() == []


def test_make_test_runs_the_request_paths_tests_on_the_compiled_build() -> None:
    makefile = (ROOT / "Makefile").read_text()
    test = re.search(r"^test: (.*)$", makefile, re.M)
    assert test is not None and "test-compiled" in test.group(1).split()
    tests = re.search(r"^COMPILED_TESTS \?= (.*)$", makefile, re.M)
    assert tests is not None
    for path in tests.group(1).split():  # directories, and the file --deselect names
        assert path.startswith("--") or (ROOT / path).exists(), path
    assert "PDO_EXPECT_COMPILED=1" in makefile


def test_the_image_compiles_the_runtime_wheel_and_gives_vllm_the_pure_one() -> None:
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    assert re.search(r"^ARG PDO_COMPILE=1$", dockerfile, re.M)
    assert "PDO_COMPILE=${PDO_COMPILE} python -m pip wheel" in dockerfile
    assert "--wheel-dir /wheels-pure ." in dockerfile
    assert "COPY --from=build /wheels-pure /tmp/wheels" in dockerfile  # vllm's Python differs
    assert "COPY pyproject.toml setup.py" in dockerfile
