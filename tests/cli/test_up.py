"""``pd-orchestrator up``: ports checked before anything starts, a run directory that
goes away, SIGHUP reloads that keep the simulators, and no simulator outliving it."""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from rich.console import Console

from pd_orchestrator.children import Child, python_command, start_child, stop_child
from pd_orchestrator.cli.gateway import endpoint_table
from pd_orchestrator.cli.up_reload import Simulated, write_resolved
from pd_orchestrator.config import ConfigError, load_config
from pd_orchestrator.model.hardware import get_profile

ROOT = Path(__file__).resolve().parents[2]
INSTANT = {"profile": "instant"}
MODEL = "sim-model"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def _listening() -> Iterator[int]:
    """A port some other process (this one) listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        yield int(sock.getsockname()[1])


def _config(threshold: float = 0.5, **decoder: Any) -> dict[str, Any]:
    return {
        "connector": "nixl",
        "decoders": [{"name": "d0", "model": MODEL, "sim": INSTANT, **decoder}],
        "prefillers": [{"name": "p0", "model": MODEL, "sim": INSTANT}],
        "threshold": {"policy": {"type": "static", "value": threshold}, "honour_client": False},
        "health": {"interval": 0.5},
    }


def _write(path: Path, config: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(config))
    return path


def _tmpdir(tmp_path: Path) -> Path:
    directory = tmp_path / "tmp"
    directory.mkdir(exist_ok=True)
    return directory


def _run_up(config: Path, tmpdir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        python_command("up", "--config", str(config), *args),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={**os.environ, "TMPDIR": str(tmpdir)},
        check=False,
    )


@contextmanager
def _up(config: Path, tmpdir: Path, *args: str) -> Iterator[Child]:
    child = start_child(
        "up",
        python_command("up", "--config", str(config), "--port", "0", *args),
        env={"TMPDIR": str(tmpdir)},
        timeout=60,
    )
    try:
        yield child
    finally:
        stop_child(child)


def _wait(condition: Callable[[], bool], what: str, limit: float = 15.0) -> None:
    deadline = time.monotonic() + limit
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _reloads(url: str, result: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    for line in text.splitlines():
        if line.startswith(f'pd_orchestrator_config_reloads_total{{result="{result}"}}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _complete(url: str, prompt: str) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "ignore_eos": True}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=30)


def _refused(url: str) -> bool:
    """Whether nothing listens at ``url`` any more (a connection refused). A server
    still shutting down may take the connection and close it unanswered, or answer
    late: not refused yet."""
    try:
        httpx.get(f"{url}/health", timeout=2)
    except httpx.ConnectError:
        return True
    except (httpx.RemoteProtocolError, httpx.ReadError, httpx.TimeoutException):
        pass  # shutting down: not refused yet
    return False


# -- the endpoint table -----------------------------------------------------------------------
def _resolved(config_path: Path) -> Any:
    """A config of ``configs/`` as ``up`` shows it: every simulated endpoint with a URL."""
    config = load_config(config_path)
    pools = []
    for p, pool in enumerate(config.pools):
        endpoints = [
            e if e.url else e.model_copy(update={"url": f"http://127.0.0.1:{40000 + 10 * p + i}"})
            for i, e in enumerate(pool.endpoints)
        ]
        pools.append(pool.model_copy(update={"endpoints": endpoints}))
    return config.model_copy(update={"pools": pools})


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "configs").glob("*.yaml")), ids=str)
@pytest.mark.parametrize("resolved", [False, True], ids=["check-config", "up"])
def test_the_endpoint_table_reads_at_80_columns(name: str, resolved: bool) -> None:
    path = ROOT / "configs" / name
    config = _resolved(path) if resolved else load_config(path)
    out = io.StringIO()
    Console(file=out, width=80, color_system=None).print(endpoint_table(config, title=name))
    lines = out.getvalue().splitlines()
    assert max(len(line) for line in lines) <= 80
    models = [line for line in lines if line.startswith("model ")]
    for endpoint in config.fleet():  # every cell whole on one line: nothing wrapped or cut
        row = next(line for line in lines if line.startswith(f"{endpoint.name} "))
        where = endpoint.url or f"sim {endpoint.sim.profile if endpoint.sim else ''}"
        hardware = endpoint.hardware
        if endpoint.group not in (hardware, "default"):
            hardware += f"/{endpoint.group}"
        for cell in (endpoint.role, endpoint.pool, hardware, where):
            assert f" {cell} " in f"{row} ", (cell, row)
        model = endpoint.model or get_profile(endpoint.sim.profile if endpoint.sim else "").model
        assert models == [f"model {model}"]  # configs/ serve one model each


def test_several_models_are_listed_below_the_table() -> None:
    config = load_config(ROOT / "configs/ask-all-h200-mi325x.yaml")
    pools = [
        pool.model_copy(update={"model": f"org/a-rather-long-model-name-{i}-Instruct"})
        for i, pool in enumerate(config.pools)
    ]
    config = config.model_copy(update={"pools": pools})
    out = io.StringIO()
    Console(file=out, width=80, color_system=None).print(endpoint_table(config, title="t"))
    lines = out.getvalue().splitlines()
    assert max(len(line) for line in lines) <= 80
    for i, pool in enumerate(config.pools):
        assert f"model org/a-rather-long-model-name-{i}-Instruct  ({pool.name})" in lines


# -- ports ------------------------------------------------------------------------------------
def test_a_busy_gateway_port_is_reported_before_any_simulator_starts(tmp_path: Path) -> None:
    config = _write(tmp_path / "up.yaml", _config())
    tmpdir = _tmpdir(tmp_path)
    with _listening() as port:
        result = _run_up(config, tmpdir, "--port", str(port))
    assert result.returncode == 1, result.stderr
    assert f"gateway port 127.0.0.1:{port} is in use" in result.stderr
    assert "nothing was started" in result.stderr
    assert "READY" not in result.stdout
    assert list(tmpdir.iterdir()) == []  # no run directory, so no simulator either


def test_busy_simulator_ports_are_all_reported_before_any_starts(tmp_path: Path) -> None:
    free = _free_port()
    config = _config()
    config["prefillers"] += [
        {"name": "p1", "model": MODEL, "sim": {**INSTANT, "port": free}},
        {"name": "p2", "model": MODEL, "sim": {**INSTANT, "port": free}},
    ]
    tmpdir = _tmpdir(tmp_path)
    with _listening() as taken:
        config["decoders"][0]["sim"] = {**INSTANT, "port": taken}
        result = _run_up(_write(tmp_path / "up.yaml", config), tmpdir, "--port", "0")
    assert result.returncode == 1, result.stderr
    assert f"simulator port 127.0.0.1:{taken} of d0 is in use" in result.stderr
    assert f"simulator port {free} of p2 is p1's too" in result.stderr
    assert list(tmpdir.iterdir()) == []
    assert _refused(f"http://127.0.0.1:{free}")


# -- the run directory ------------------------------------------------------------------------
def test_the_run_directory_holds_the_logs_and_is_removed_on_exit(tmp_path: Path) -> None:
    tmpdir = _tmpdir(tmp_path)
    with _up(_write(tmp_path / "up.yaml", _config()), tmpdir):
        (run,) = tmpdir.iterdir()
        assert run.name.startswith("pdo-up-")
        logs = sorted(p.name.split("-", 1)[0] for p in (run / "logs").iterdir())
        assert logs == ["d0", "p0"]
    assert list(tmpdir.iterdir()) == []


def test_a_failed_simulator_start_keeps_its_logs_and_stops_the_others(tmp_path: Path) -> None:
    port = _free_port()
    config = _config()
    config["decoders"][0]["sim"] = {**INSTANT, "port": port}  # starts first, fine
    config["prefillers"][0]["sim"] = {**INSTANT, "extra_args": ["--no-such-flag"]}
    tmpdir = _tmpdir(tmp_path)
    result = _run_up(_write(tmp_path / "up.yaml", config), tmpdir, "--port", "0")
    assert result.returncode == 1
    assert "p0 exited with 2 before it was ready" in result.stderr
    (run,) = tmpdir.iterdir()
    assert f"logs are kept in {run / 'logs'}" in result.stderr.replace("\n", "")
    assert [p.name for p in run.iterdir()] == ["logs"]
    (log,) = (run / "logs").glob("p0-*.log")
    assert "unrecognized arguments: --no-such-flag" in log.read_text()
    assert _refused(f"http://127.0.0.1:{port}")  # d0 was stopped


# -- SIGHUP -----------------------------------------------------------------------------------
def test_sighup_reloads_the_file_and_keeps_the_simulated_endpoints(tmp_path: Path) -> None:
    path = _write(tmp_path / "up.yaml", _config(threshold=1.0))
    state = tmp_path / "state.json"
    with _up(path, _tmpdir(tmp_path), "--state-file", str(state)) as up:
        cold = _complete(up.url, f"{uuid.uuid4().hex} a cold prompt " * 4)
        assert (cold.status_code, cold.headers["x-pd-decision"]) == (200, "pd")
        _write(path, _config(threshold=0.0))
        up.process.send_signal(signal.SIGHUP)
        _wait(lambda: _reloads(up.url, "applied") == 1, "the reload")
        colder = _complete(up.url, f"{uuid.uuid4().hex} another cold prompt " * 4)
        assert colder.status_code == 200
        assert colder.headers["x-pd-decision"] == "decode"  # threshold 0 admits it
        assert colder.headers["x-pd-decoder"] == "d0"
        assert up.process.poll() is None
        endpoints = json.loads(state.read_text())["endpoints"]
        assert all(httpx.get(e["url"] + "/health").status_code == 200 for e in endpoints)


def test_a_reload_naming_a_new_simulated_endpoint_is_refused(tmp_path: Path) -> None:
    path = _write(tmp_path / "up.yaml", _config())
    with _up(path, _tmpdir(tmp_path)) as up:
        grown = _config()
        grown["decoders"].append({"name": "d1", "model": MODEL, "sim": INSTANT})
        _write(path, grown)
        up.process.send_signal(signal.SIGHUP)
        _wait(lambda: _reloads(up.url, "refused") == 1, "the refusal")
        assert _reloads(up.url, "applied") == 0
        answer = _complete(up.url, f"{uuid.uuid4().hex} still served " * 4)
        assert answer.status_code == 200 and answer.headers["x-pd-decoder"] == "d0"


def test_a_sighup_while_up_starts_is_applied_once_ready(tmp_path: Path) -> None:
    path = _write(tmp_path / "up.yaml", _config())
    tmpdir = _tmpdir(tmp_path)
    with subprocess.Popen(
        python_command("up", "--config", str(path), "--port", "0"),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "TMPDIR": str(tmpdir)},
        process_group=0,
    ) as process:
        try:
            _wait(lambda: any(tmpdir.iterdir()), "the run directory")  # SIGHUP is handled
            process.send_signal(signal.SIGHUP)
            assert process.stdout is not None
            url = ""
            for line in process.stdout:  # bounded by the test's timeout
                if line.startswith("READY "):
                    url = line.split()[1]
                    break
            assert url, f"up exited with {process.wait(5)}"
            _wait(lambda: _reloads(url, "applied") == 1, "the deferred reload")
        finally:
            process.send_signal(signal.SIGTERM)
            assert process.wait(15) == 0
    assert list(tmpdir.iterdir()) == []


# -- no simulator outlives up -----------------------------------------------------------------
def test_the_simulators_die_with_up_even_on_sigkill(tmp_path: Path) -> None:
    state = tmp_path / "state.json"
    path = _write(tmp_path / "up.yaml", _config())
    with _up(path, _tmpdir(tmp_path), "--state-file", str(state)) as up:
        urls = [e["url"] for e in json.loads(state.read_text())["endpoints"]]
        assert not any(_refused(url) for url in urls)
        os.kill(up.process.pid, signal.SIGKILL)
        up.process.wait(10)
        _wait(lambda: all(_refused(url) for url in urls), "the simulators to stop")


# -- the resolved copy the gateway reloads ----------------------------------------------------
def test_write_resolved_keeps_the_running_simulators(tmp_path: Path) -> None:
    source = tmp_path / "up.yaml"
    config = _config()
    config["pools"] = [
        {
            "name": "extra",
            "role": "decode",
            "group": "default",
            "endpoints": [{"name": "real", "url": "http://10.1.2.3:8000", "model": MODEL}],
        }
    ]
    _write(source, config)
    running = {
        "d0": Simulated("http://127.0.0.1:1111", MODEL),
        "p0": Simulated("http://127.0.0.1:2222", MODEL),
    }
    target = tmp_path / "resolved.yaml"
    resolved = write_resolved(source, target, running)
    urls = {e.name: e.url for e in resolved.fleet()}
    assert urls == {
        "real": "http://10.1.2.3:8000",
        "d0": running["d0"].url,
        "p0": running["p0"].url,
    }
    assert {e.name: e.url for e in load_config(target).fleet()} == urls
    with pytest.raises(ConfigError, match=r"up\.yaml: no url and no running simulator for p0"):
        write_resolved(source, target, {"d0": running["d0"]})
    source.write_text("decoders: [")
    with pytest.raises(ConfigError, match=r"up\.yaml is not valid YAML"):
        write_resolved(source, target, running)


def _shared(url: str) -> dict[str, Any]:
    shared: dict[str, Any] = httpx.get(f"{url}/status", timeout=5).json()["shared_state"]
    return shared


def test_with_shared_state_up_runs_a_nats_server_for_the_gateway_and_stops_it(
    tmp_path: Path,
) -> None:
    path = _write(tmp_path / "up.yaml", _config())
    with _up(path, _tmpdir(tmp_path), "--shared-state") as up:
        _wait(lambda: _shared(up.url)["connected"], "the gateway to reach the server")
        shared = _shared(up.url)
        assert shared["url"].startswith("nats://127.0.0.1:")
        assert (shared["peers"], shared["counting"]) == (0, "shared")
        assert _complete(up.url, "a prompt").status_code == 200
        up.process.send_signal(signal.SIGHUP)  # a reload keeps the server it started
        _wait(lambda: _reloads(up.url, "applied") == 1, "the reload")
        _wait(lambda: _shared(up.url)["connected"], "the reloaded gateway to reach it")
        port = int(shared["url"].rsplit(":", 1)[1])
    with pytest.raises(OSError):  # the server stopped with up
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
