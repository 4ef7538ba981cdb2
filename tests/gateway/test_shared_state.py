"""Several gateways, one fleet, end to end: two gateway processes share their load
through a real NATS server (each counts the requests the other has in flight at a
decoder), and a gateway whose server is unreachable serves alone, says so, and joins
once the server is up. Simulators, gateways and the NATS server are real processes on
loopback."""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import anyio
import httpx
import pytest

from pd_orchestrator.bench.peers import free_port
from pd_orchestrator.children import nats_server_command

from ..conftest import GatewayFactory, SimFactory
from .helpers import call, metric, metrics_text

pytestmark = pytest.mark.anyio


class Nats:
    """A NATS server on a loopback port, started and stopped by the test."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self) -> None:
        argv = [nats_server_command(), "-a", "127.0.0.1", "-p", str(self.port)]
        self.process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), 0.2):
                    return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("the NATS server did not start")

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(10)
            self.process = None


@pytest.fixture
def nats_server() -> Iterator[Nats]:
    server = Nats(free_port())
    try:
        yield server
    finally:
        server.stop()


def _config(sim_factory: SimFactory, url: str) -> dict[str, Any]:
    slow = ("--profile", "h200-llama3-8b", "--model", "sim-model", "--time-scale", "10")
    decoder = sim_factory(*slow, "--kv-connector", "nixl", name="decode")
    prefiller = sim_factory(*slow, "--kv-connector", "nixl", name="prefill")
    pools = [
        {"name": "decode", "role": "decode", "hardware": "h200", "model": "sim-model",
         "endpoints": [{"name": "d0", "url": decoder.url}]},
        {"name": "prefill", "role": "prefill", "hardware": "h200", "model": "sim-model",
         "endpoints": [{"name": "p0", "url": prefiller.url}]},
    ]  # fmt: skip
    return {
        "pools": pools,
        # no start-up timing: its prompts would hold the slow decoder for seconds
        "threshold": {"policy": {"type": "goodput", "params": {"probe_tokens": []}}},
        "health": {"interval": 0.5},
        "shared_state": {"url": url, "interval": 0.05, "ttl": 1.0},
    }


async def _status(url: str) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=10) as client:
        document: dict[str, Any] = (await client.get(f"{url}/status")).json()
        return document


async def _until(url: str, check: Any, seconds: float = 15.0) -> dict[str, Any]:
    """The gateway's ``/status`` once ``check`` holds for it (fails after ``seconds``)."""
    with anyio.fail_after(seconds):
        while True:
            status = await _status(url)
            if check(status):
                return status
            await anyio.sleep(0.05)


def _in_flight(status: dict[str, Any], name: str) -> int:
    (endpoint,) = [e for e in status["endpoints"] if e["name"] == name]
    return int(endpoint["in_flight"])


async def test_two_gateways_count_each_other_s_requests_at_a_decoder(
    sim_factory: SimFactory, gateway_factory: GatewayFactory, nats_server: Nats
) -> None:
    nats_server.start()
    config = _config(sim_factory, nats_server.url)
    first, second = gateway_factory(config), gateway_factory(config)
    for gateway in (first, second):
        await _until(gateway.url, lambda s: s["shared_state"]["peers"] == 1)
    body = {"model": "sim-model", "prompt": "hello " * 40, "max_tokens": 60, "stream": True}
    body |= {"ignore_eos": True}
    async with httpx.AsyncClient(base_url=first.url, timeout=60) as client:
        async with client.stream("POST", "/v1/completions", json=body) as answer:
            assert answer.status_code == 200
            lines = answer.aiter_lines()
            while not (await anext(lines)).startswith("data: {"):
                pass
            # the second gateway relays nothing, yet counts the first one's stream
            seen = await _until(second.url, lambda s: _in_flight(s, "d0") == 1)
            assert seen["shared_state"]["connected"] is True
            assert _in_flight(await _status(first.url), "d0") == 1  # its own, not twice
            async for _ in lines:
                pass
    await _until(second.url, lambda s: _in_flight(s, "d0") == 0)
    text = await metrics_text(second.url)
    assert metric(text, "pd_orchestrator_shared_state_connected") == 1
    assert metric(text, "pd_orchestrator_shared_state_peers") == 1


async def test_with_its_server_unreachable_a_gateway_serves_alone_and_joins_once_it_is_up(
    sim_factory: SimFactory, gateway_factory: GatewayFactory, nats_server: Nats
) -> None:
    gateway = gateway_factory(_config(sim_factory, nats_server.url))  # nothing listens yet
    status = await _until(gateway.url, lambda s: s["shared_state"]["last_error"] is not None)
    assert status["shared_state"]["connected"] is False
    assert status["shared_state"]["counting"] == "own state only"
    body = {"model": "sim-model", "prompt": "hello there", "max_tokens": 3}
    started = time.monotonic()
    answer = await call(gateway.url, "completion", body)
    assert answer.status == 200 and answer.text
    assert time.monotonic() - started < 10  # no request waits for the server
    assert metric(await metrics_text(gateway.url), "pd_orchestrator_shared_state_connected") == 0
    nats_server.start()
    joined = await _until(gateway.url, lambda s: s["shared_state"]["connected"], seconds=20)
    assert joined["shared_state"]["counting"] == "shared"
    nats_server.stop()  # lost again: back to its own state
    await _until(gateway.url, lambda s: not s["shared_state"]["connected"], seconds=20)
