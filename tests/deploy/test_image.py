"""The container recipe (deploy/Dockerfile), checked without a container engine: its
stages, its unprivileged user, its health check (run for real against a server), and
its runtime lock (the project lock's pins, closed under dependencies)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from pd_orchestrator.cli.main import build_parser

from ..conftest import SimFactory

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
RUNTIME_LOCK = ROOT / "requirements" / "runtime.lock"
PROJECT_LOCK = ROOT / "requirements" / "lock.txt"
VENV = "/opt/pd-orchestrator"


@dataclass
class Stage:
    name: str
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, keyword: str) -> list[str]:
        return [args for kw, args in self.instructions if kw == keyword]


def _logical_lines(text: str) -> list[str]:
    """Instructions with their continuation lines joined; comments dropped."""
    lines: list[str] = []
    pending = ""
    for raw in text.splitlines():
        stripped = raw.strip()
        if stripped.startswith("#") or (not stripped and not pending):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        lines.append(pending + stripped)
        pending = ""
    assert not pending, "a continuation line ends the file"
    return lines


def parse(text: str) -> tuple[dict[str, str], list[Stage]]:
    """Global ARG defaults and the stages of a Dockerfile."""
    args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in _logical_lines(text):
        keyword, _, rest = line.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            match = re.fullmatch(r"(\S+)\s+AS\s+(\S+)", rest.strip(), re.IGNORECASE)
            assert match, f"every stage is named: {line}"
            stages.append(Stage(match[2], match[1]))
        elif not stages:
            assert keyword == "ARG", f"only ARG before the first FROM: {line}"
            name, _, default = rest.partition("=")
            args[name.strip()] = default.strip()
        else:
            stages[-1].instructions.append((keyword, rest.strip()))
    return args, stages


@pytest.fixture(scope="module")
def dockerfile() -> tuple[dict[str, str], list[Stage]]:
    return parse(DOCKERFILE.read_text())


def _stage(stages: list[Stage], name: str) -> Stage:
    return next(stage for stage in stages if stage.name == name)


def _pins(path: Path) -> dict[str, tuple[str, str]]:
    """canonical name -> (name as written, version) of a ``name==version`` file."""
    pins: dict[str, tuple[str, str]] = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        match = re.fullmatch(r"([A-Za-z0-9._-]+)==([A-Za-z0-9.+!-]+)", line)
        assert match, f"{path.name}: not an exact pin: {line!r}"
        pins[canonicalize_name(match[1])] = (match[1], match[2])
    return pins


# -- stages -----------------------------------------------------------------------------------
def test_a_build_stage_then_a_runtime_stage_by_default(
    dockerfile: tuple[dict[str, str], list[Stage]],
) -> None:
    args, stages = dockerfile
    assert [stage.name for stage in stages] == ["build", "vllm", "runtime"]  # last = default
    build, runtime = _stage(stages, "build"), stages[-1]
    assert build.base == runtime.base == "${PYTHON_IMAGE}"
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    python = project["tool"]["mypy"]["python_version"]
    assert args["PYTHON_IMAGE"].startswith(f"python:{python}-slim")  # the lock's markers hold
    assert any("wheel" in run and "--no-build-isolation" in run for run in build.all("RUN"))


def test_the_runtime_stage_copies_the_environment_and_installs_nothing(
    dockerfile: tuple[dict[str, str], list[Stage]],
) -> None:
    runtime = dockerfile[1][-1]
    assert runtime.all("COPY") == [f"--from=build {VENV} {VENV}"]
    assert not any("pip" in run for run in runtime.all("RUN"))
    assert not runtime.all("ADD")


def test_the_runtime_environment_is_exactly_the_runtime_lock(
    dockerfile: tuple[dict[str, str], list[Stage]],
) -> None:
    build = _stage(dockerfile[1], "build")
    (venv,) = [run for run in build.all("RUN") if f"venv {VENV}" in run]
    steps = [shlex.split(step) for step in venv.split("&&")]
    pip = f"{VENV}/bin/pip"
    installs = [step for step in steps if step[:2] == [pip, "install"]]
    assert installs == [
        [pip, "install", "--no-deps", "--requirement", "requirements/runtime.lock"],
        [pip, "install", "--no-deps", "/wheels/pd_orchestrator-*.whl"],
    ]
    assert [pip, "check"] in steps  # --no-deps: a missing pin fails the build here
    assert steps.index([pip, "check"]) > steps.index(installs[-1])
    for run in build.all("RUN"):  # the project lock only constrains the build tools
        if "lock.txt" in run:
            assert "--constraint requirements/lock.txt setuptools wheel" in run


def test_the_runtime_stage_runs_as_an_unprivileged_user(
    dockerfile: tuple[dict[str, str], list[Stage]],
) -> None:
    runtime = dockerfile[1][-1]
    keywords = [keyword for keyword, _ in runtime.instructions]
    user = runtime.all("USER")[-1]
    uid, _, gid = user.partition(":")
    assert uid.isdigit() and int(uid) > 0, "a numeric uid lets Kubernetes check runAsNonRoot"
    assert gid.isdigit() and int(gid) > 0
    last_user = len(keywords) - 1 - keywords[::-1].index("USER")
    assert "RUN" not in keywords[last_user:], "nothing runs as root after USER"
    assert any(f"--uid {uid}" in run for run in runtime.all("RUN"))


def test_the_entrypoint_runs_every_command_and_serves_by_default(
    dockerfile: tuple[dict[str, str], list[Stage]],
) -> None:
    runtime = dockerfile[1][-1]
    assert runtime.all("ENTRYPOINT") == ['["pd-orchestrator"]']
    (cmd,) = runtime.all("CMD")
    args = build_parser().parse_args(json.loads(cmd))  # exec form: a JSON list
    assert args.command == "serve" and args.host == "0.0.0.0"


# -- the health check, run -------------------------------------------------------------------
def _healthcheck(dockerfile: tuple[dict[str, str], list[Stage]]) -> tuple[list[str], str]:
    runtime = dockerfile[1][-1]
    (check,) = runtime.all("HEALTHCHECK")
    options, _, command = check.partition("CMD ")
    assert "--interval=" in options and "--timeout=" in options
    (env,) = [e for e in runtime.all("ENV") if "PD_ORCHESTRATOR_HEALTH_URL=" in e]
    default = re.search(r"PD_ORCHESTRATOR_HEALTH_URL=(\S+)", env)
    assert default is not None
    return json.loads(command), default[1]


def test_the_health_check_probes_health(
    dockerfile: tuple[dict[str, str], list[Stage]], sim_factory: SimFactory
) -> None:
    argv, default = _healthcheck(dockerfile)
    assert default == "http://127.0.0.1:8000/health"
    assert argv[0] == "python"
    server = sim_factory("--profile", "instant")
    run = [sys.executable, *argv[1:]]

    def probe(url: str) -> int:
        env = {**os.environ, "PD_ORCHESTRATOR_HEALTH_URL": url}
        return subprocess.run(run, env=env, capture_output=True, timeout=30).returncode

    assert probe(f"{server.url}/health") == 0
    assert probe(f"{server.url}/no-such-route") != 0
    port = server.url.rsplit(":", 1)[1]
    assert probe(f"http://127.0.0.1:{int(port) ^ 1}/health") != 0  # nothing listens there


# -- the runtime lock -------------------------------------------------------------------------
def test_the_runtime_lock_pins_what_the_project_lock_pins() -> None:
    runtime, project = _pins(RUNTIME_LOCK), _pins(PROJECT_LOCK)
    for name, (written, version) in runtime.items():
        assert name in project, f"{written} is not in requirements/lock.txt"
        assert project[name][1] == version, f"{written}: {version} vs {project[name][1]}"


def _runtime_roots() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    events = project["optional-dependencies"]["events"]
    return [Requirement(r) for r in [*project["dependencies"], *events]]


def _closure(roots: list[Requirement]) -> dict[str, str]:
    """canonical name -> installed version of ``roots`` and all they need here
    (markers evaluated for this interpreter, the image's Python)."""
    found: dict[str, str] = {}
    todo = [(root, frozenset(root.extras)) for root in roots]
    while todo:
        requirement, extras = todo.pop()
        name = canonicalize_name(requirement.name)
        if name in found:
            continue
        found[name] = metadata.version(requirement.name)
        for line in metadata.requires(requirement.name) or []:
            needed = Requirement(line)
            environments = [default_environment() | {"extra": e} for e in extras or {""}]
            if needed.marker is None or any(needed.marker.evaluate(e) for e in environments):
                todo.append((needed, frozenset(needed.extras)))
    return found


def test_the_runtime_lock_is_the_closure_of_the_runtime_dependencies() -> None:
    runtime = _pins(RUNTIME_LOCK)
    for root in _runtime_roots():
        assert canonicalize_name(root.name) in runtime, f"{root.name} is not pinned"
        assert root.specifier.contains(runtime[canonicalize_name(root.name)][1]), root
    closure = _closure(_runtime_roots())
    assert sorted(closure) == sorted(runtime), "missing or needless pins"
    for name, version in closure.items():  # this venv is built from the same pins
        assert version == runtime[name][1], f"{name}: installed {version}"


# -- the build context ------------------------------------------------------------------------
def test_the_dockerignore_keeps_only_what_the_build_copies(
    dockerfile: tuple[dict[str, str], list[Stage]],
) -> None:
    rules = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert rules[0] == "*"
    kept = {rule[1:].rstrip("/") for rule in rules if rule.startswith("!")}
    sources = set()
    for stage in dockerfile[1]:
        for copy in stage.all("COPY"):
            if copy.startswith("--from="):
                continue
            sources.update(copy.split()[:-1])
    assert {source.rstrip("/") for source in sources} == kept
    assert all((ROOT / source).exists() for source in sources)
