"""Every command of the command line, as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys
from contextlib import ExitStack
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
import yaml

from connectors import TransferContext, get_connector
from pd_orchestrator.children import RunDirectory, python_command, start_child, stop_child
from pd_orchestrator.cli.up import resolve_simulated
from pd_orchestrator.config import parse_config

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        python_command(*args), capture_output=True, text=True, timeout=60, cwd=ROOT, check=False
    )


def test_version_and_help() -> None:
    assert _run("--version").stdout.startswith("pd-orchestrator ")
    assert "check-config" in _run("--help").stdout


def test_check_config_prints_the_effective_config() -> None:
    result = _run("check-config", "configs/local.yaml")
    assert result.returncode == 0, result.stderr
    assert "valid" in result.stdout and "decode-0" in result.stdout
    assert '"leg_threshold"' in result.stdout


def test_check_config_rejects_an_unknown_key(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"decoders": [{"name": "d", "url": "http://h:1", "colour": 1}]}))
    result = _run("check-config", str(bad))
    assert result.returncode == 2
    assert "decoders.0.colour: unknown key" in result.stderr


def test_serve_refuses_endpoints_without_url() -> None:
    result = _run("serve", "--config", "configs/local.yaml", "--port", "0")
    assert result.returncode == 2 and "without a url" in result.stderr


def test_sim_rejects_an_unknown_profile() -> None:
    result = _run("sim", "--profile", "tpu-v9")
    assert result.returncode == 2 and "unknown profile 'tpu-v9'" in result.stderr
    assert "or a profile file" in result.stderr


def test_python_dash_m_entry_point() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pd_orchestrator", "--help"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0 and "serve" in result.stdout


def test_up_starts_the_simulators_and_the_gateway_and_stops_them(tmp_path: Path) -> None:
    sim = {"profile": "instant"}
    config = {
        "connector": "nixl",
        "decoders": [{"name": "d0", "sim": sim}],
        "prefillers": [{"name": "p0", "sim": sim}],
        "threshold": {"policy": {"value": 0.5}},
    }
    path = tmp_path / "demo.yaml"
    path.write_text(yaml.safe_dump(config))
    state = tmp_path / "state.json"
    argv = python_command("up", "--config", str(path), "--port", "0", "--state-file", str(state))
    child = start_child("up", argv, timeout=60)
    try:
        with httpx.Client(base_url=child.url, timeout=10) as client:
            models = client.get("/v1/models").json()["data"]
            body = {"model": models[0]["id"], "prompt": "hello " * 20, "max_tokens": 4}
            answer = client.post("/v1/completions", json=body)
        assert answer.status_code == 200
        assert answer.headers["x-pd-decision"] == "pd"
        assert answer.headers["x-pd-decoder"] == "d0"
        endpoints = json.loads(state.read_text())["endpoints"]
        assert [(e["name"], e["role"]) for e in endpoints] == [("d0", "decode"), ("p0", "prefill")]
        assert all(httpx.get(e["url"] + "/health").status_code == 200 for e in endpoints)
    finally:
        assert stop_child(child) == 0  # a clean exit on SIGTERM
    for endpoint in [*endpoints, {"url": child.url}]:  # everything it started is gone
        with pytest.raises(httpx.ConnectError):
            httpx.get(endpoint["url"] + "/health", timeout=2)


def test_up_gives_each_simulator_its_own_side_channels(tmp_path: Path) -> None:
    """The simulators `up` starts answer the connectors at the addresses the config says."""
    sim = {"profile": "instant"}
    config = parse_config(
        {
            "connector": "mooncake",
            "decoders": [{"name": "d0", "sim": sim}],
            "prefillers": [{"name": "p0", "sim": sim}],
        }
    )
    with ExitStack() as stack:
        run = stack.enter_context(RunDirectory())
        resolved, children = resolve_simulated(config, stack, run)
        fleet = {e.name: e for e in resolved.fleet()}
        child = next(c for c in children if c.name == "p0")
        peer = fleet["p0"].peer
        assert (peer.host, peer.bootstrap_port, peer.engine_id) == ("127.0.0.1", child.port, "p0")
        unknown = TransferContext("r", "t", replace(peer, engine_id=None), fleet["d0"].peer)
        (lookup,) = get_connector("mooncake").lookups(unknown)  # the bootstrap's /query
        learned = lookup.parse(httpx.get(lookup.url, timeout=10).json())
        assert learned.engine_id == "p0"
