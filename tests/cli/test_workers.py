"""``serve --workers N``: several gateway processes on one port."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml
from pydantic import ValidationError

from pd_orchestrator.children import python_command, start_child, stop_child
from pd_orchestrator.config.settings import ListenConfig

from ..conftest import SimFactory, gateway_config

MODEL = "sim-model"
INSTANT = ("--profile", "instant", "--kv-connector", "nixl")


def _free_ports(count: int) -> int:
    """P such that P .. P + count - 1 are free now (a busy machine holds many ports)."""
    while True:
        with socket.socket() as first:
            first.bind(("127.0.0.1", 0))
            port = int(first.getsockname()[1])
            if port + count > 65536:
                continue
            held = []
            try:
                for offset in range(1, count):
                    sock = socket.socket()
                    held.append(sock)
                    sock.bind(("127.0.0.1", port + offset))
            except OSError:
                continue
            finally:
                for sock in held:
                    sock.close()
            return port


def _reloads(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=5).text
    for line in text.splitlines():
        if line.startswith('pd_orchestrator_config_reloads_total{result="applied"}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _descendants(pid: int) -> set[int]:
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.add(int(entry.name))
    return found


def test_two_workers_share_the_port_reload_together_and_stop_together(
    sim_factory: SimFactory, tmp_path: Path
) -> None:
    decoder, prefiller = sim_factory(*INSTANT), sim_factory(*INSTANT)
    metrics_port = _free_ports(2)
    config = gateway_config([decoder], [prefiller])
    config["listen"] = {"workers": 2, "worker_metrics_port": metrics_port}
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump(config))
    gateway = start_child("gateway", python_command("serve", "--config", str(path), "--port", "0"))
    try:
        workers = _descendants(gateway.process.pid)
        assert len(workers) == 2
        body = {"model": MODEL, "prompt": "hello", "max_tokens": 2}
        prefixes = set()
        for _ in range(30):  # a new connection each: the kernel spreads them
            response = httpx.post(gateway.url + "/v1/completions", json=body, timeout=10)
            assert response.status_code == 200
            prefixes.add(response.headers["x-request-id"][:12])  # one prefix per process
        assert len(prefixes) == 2

        own = [f"http://127.0.0.1:{metrics_port + i}" for i in range(2)]
        assert [_reloads(url) for url in own] == [0.0, 0.0]
        os.kill(gateway.process.pid, signal.SIGHUP)  # the parent forwards it
        for _ in range(100):
            if [_reloads(url) for url in own] == [1.0, 1.0]:
                break
            time.sleep(0.1)
        assert [_reloads(url) for url in own] == [1.0, 1.0]
    finally:
        status = stop_child(gateway)
    assert status == 0
    assert not any(Path(f"/proc/{pid}").exists() for pid in workers)


@pytest.mark.parametrize("workers", [0, 65])
def test_the_number_of_workers_is_bounded(workers: int) -> None:
    with pytest.raises(ValidationError, match="workers"):
        ListenConfig.model_validate({"workers": workers})


def test_a_worker_that_cannot_start_stops_the_others_at_once(
    sim_factory: SimFactory, tmp_path: Path
) -> None:
    """Worker 1's own metrics port is taken: serve exits non-zero, saying why, without
    waiting for the start-up bound and without leaving worker 0 behind."""
    decoder, prefiller = sim_factory(*INSTANT), sim_factory(*INSTANT)
    metrics_port = _free_ports(2)
    config = gateway_config([decoder], [prefiller])
    config["listen"] = {"workers": 2, "worker_metrics_port": metrics_port}
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump(config))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", metrics_port + 1))
        taken.listen()
        log = tmp_path / "serve.log"
        with log.open("wb") as out:
            process = subprocess.Popen(
                python_command("serve", "--config", str(path), "--port", "0"),
                stdout=out,
                stderr=subprocess.STDOUT,
            )
            try:
                status = process.wait(timeout=60)  # the start-up bound is 120 s
            finally:
                if process.poll() is None:
                    process.kill()
                    process.wait()
    assert status == 1
    text = log.read_text()
    assert "worker 1 failed" in text and "not every worker started" in text
    assert "READY" not in text
