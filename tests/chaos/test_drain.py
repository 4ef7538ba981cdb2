"""SIGTERM with long answers in flight: the gateway drains.

At once ``/ready`` answers 503 (on a connection still open; the answer closes it)
and no new connection is accepted; a request sent afterwards on a connection left
open is served, that connection then closed. Answers in flight within ``lifecycle.drain_seconds``
end identical to the reference; those still running when it runs out end with one
clean error (a stream: one SSE error event then ``[DONE]``; a whole answer: a 503),
their upstream requests closed. Then the process exits with status 0. The same
holds for ``serve --workers 2`` (the parent forwards the signal) and for ``up``.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
from pathlib import Path
from typing import Any

import anyio
import httpx
import orjson
import pytest
import yaml

from pd_orchestrator.children import Child, python_command, start_child, stop_child

from ..conftest import GatewayFactory, SimFactory, gateway_config
from ..gateway.helpers import read_answer, read_to_close
from .harness import (
    MODEL,
    NIXL,
    Fleet,
    Progress,
    Tally,
    jobs,
    poll,
    run_jobs,
    settle,
    start_fleet,
)

pytestmark = pytest.mark.anyio


async def _exited(process: subprocess.Popen[str], bound: float = 30.0) -> int:
    async def gone() -> bool:
        return process.poll() is not None

    await poll(gone, bound, 0.05)
    return int(process.returncode)


async def _refused(url: str) -> bool:
    """Whether new connections to ``url`` are refused. One the server took while it
    stopped listening may be closed unanswered, or answered late: not refused yet."""
    try:
        async with httpx.AsyncClient(timeout=2) as http:
            await http.get(f"{url}/health")
    except httpx.ConnectError:
        return True
    except (httpx.RemoteProtocolError, httpx.ReadError, httpx.TimeoutException):
        pass  # still closing: poll again
    return False


async def _drain(
    fleet: Fleet, progress: Progress, process: subprocess.Popen[str]
) -> dict[str, Any]:
    """Once answers stream, SIGTERM ``process``; check ``/ready`` on a connection opened
    before and that new connections are refused; returns what was seen."""
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    async with httpx.AsyncClient(base_url=fleet.url, timeout=10, limits=limits) as kept:
        assert (await kept.get("/ready")).status_code == 200  # the connection stays open
        await progress.wait(streams=2)
        process.send_signal(signal.SIGTERM)
        await anyio.sleep(0.2)
        ready = await kept.get("/ready")
    await poll(lambda: _refused(fleet.url), 10.0, 0.05)
    return {
        "ready": ready.status_code,
        "draining": ready.json()["draining"],
        "closes": ready.headers.get("connection"),
    }


@pytest.mark.parametrize("workers", [1, 2], ids=["serve", "serve-workers-2"])
async def test_answers_in_flight_finish_within_the_grace(
    sim_factory: SimFactory, gateway_factory: GatewayFactory, reference: Child, workers: int
) -> None:
    fleet = start_fleet(
        sim_factory, gateway_factory, reference,
        lifecycle={"drain_seconds": 60.0}, listen={"workers": workers},
    )  # fmt: skip
    how = "serve" if workers == 1 else "serve --workers 2"
    tally = Tally(f"SIGTERM, answers within the grace ({how})")
    progress, seen = Progress(), {}

    async def drain() -> None:
        seen.update(await _drain(fleet, progress, fleet.gateway.process))

    async with anyio.create_task_group() as tg:
        tg.start_soon(drain)
        await run_jobs(fleet, jobs(10, max_tokens=96), tally, progress=progress)
    tally.notes |= {**seen, "exit": await _exited(fleet.gateway.process)}
    tally.check(max_clean_errors=0)
    assert seen == {"ready": 503, "draining": True, "closes": "close"}
    assert tally.notes["exit"] == 0
    await settle(fleet.upstreams)


async def test_answers_still_running_after_the_grace_end_with_one_clean_error(
    sim_factory: SimFactory, gateway_factory: GatewayFactory, reference: Child
) -> None:
    fleet = start_fleet(sim_factory, gateway_factory, reference, lifecycle={"drain_seconds": 1.0})
    tally = Tally("SIGTERM, answers beyond the grace")
    progress, seen = Progress(), {}

    async def drain() -> None:
        seen.update(await _drain(fleet, progress, fleet.gateway.process))

    async with anyio.create_task_group() as tg:
        tg.start_soon(drain)
        await run_jobs(fleet, jobs(8, max_tokens=600), tally, progress=progress)
    tally.notes |= {**seen, "exit": await _exited(fleet.gateway.process)}
    tally.check()
    assert tally.clean_errors == tally.requests  # every answer was cut, cleanly
    assert seen["ready"] == 503 and tally.notes["exit"] == 0
    await settle(fleet.upstreams)  # the gateway closed their upstream requests


def _ask(sock: socket.socket, request: bytes) -> tuple[int, dict[str, str], bytes]:
    sock.sendall(request)
    return read_answer(sock)


async def test_a_request_on_an_idle_connection_after_sigterm_is_served(
    sim_factory: SimFactory, gateway_factory: GatewayFactory
) -> None:
    """SIGTERM with nothing in flight and a keep-alive connection open: a request the
    client sends on it once new connections are refused is answered (with
    ``Connection: close``), then the process exits. Old: the drain ended at once and
    closed the idle connection under the request (the client got no answer)."""
    decoder, prefiller = (sim_factory("--profile", "instant", *NIXL) for _ in range(2))
    limits = {"keepalive_timeout": 60.0}  # the connection stays open whatever the machine's pace
    gateway = gateway_factory(gateway_config([decoder], [prefiller], limits=limits))
    body = orjson.dumps({"model": MODEL, "prompt": "drained", "max_tokens": 4})
    completion = (
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%s" % (len(body), body)
    )
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=30) as sock:
        health = b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n"
        assert (await anyio.to_thread.run_sync(_ask, sock, health))[0] == 200
        gateway.process.send_signal(signal.SIGTERM)
        await poll(lambda: _refused(gateway.url), 10.0, 0.05)
        status, headers, answer = await anyio.to_thread.run_sync(_ask, sock, completion)
        rest = await anyio.to_thread.run_sync(read_to_close, sock)
    assert status == 200 and headers["connection"] == "close"
    assert orjson.loads(answer)["usage"]["completion_tokens"] == 4
    assert rest == b""  # closed after the answer
    assert await _exited(gateway.process) == 0


def _up_config(path: Path, gateway_port: int) -> dict[str, Any]:
    sim = {"profile": "h200-llama3-8b", "time_scale": 4.0, "seed": 0}
    decoders = [{"name": "decode-0"}, {"name": "decode-1"}]
    prefillers = [{"name": "prefill-0"}]
    config = {
        "listen": {"port": gateway_port},
        "connector": "nixl",
        "pools": [
            {
                "name": "decoders",
                "role": "decode",
                "model": MODEL,
                "sim": sim,
                "endpoints": decoders,
            },
            {
                "name": "prefillers",
                "role": "prefill",
                "model": MODEL,
                "sim": {**sim, "profile": "instant"},
                "endpoints": prefillers,
            },
        ],
        "threshold": {"policy": {"type": "static", "value": 0.5}},
        "health": {"interval": 0.5},
        "lifecycle": {"drain_seconds": 60.0},
    }
    path.write_text(yaml.safe_dump(config))
    return config


async def test_up_drains_then_stops_its_simulators(reference: Child, tmp_path: Path) -> None:
    config_path, state = tmp_path / "up.yaml", tmp_path / "state.json"
    _up_config(config_path, 0)
    argv = python_command("up", "--config", str(config_path), "--state-file", str(state))
    up = start_child("up", argv, timeout=90)
    try:
        pids = [e["pid"] for e in json.loads(state.read_text())["endpoints"]]
        fleet = Fleet([], [], reference, up, {})
        tally = Tally("SIGTERM, answers within the grace (up)")
        progress, seen = Progress(), {}

        async def drain() -> None:
            seen.update(await _drain(fleet, progress, up.process))

        async with anyio.create_task_group() as tg:
            tg.start_soon(drain)
            await run_jobs(fleet, jobs(6, max_tokens=96), tally, progress=progress)
        tally.notes |= {**seen, "exit": await _exited(up.process)}
        tally.check(max_clean_errors=0)
        assert seen["ready"] == 503 and tally.notes["exit"] == 0
        assert not [pid for pid in pids if _alive(pid)]  # its simulators went with it
    finally:
        stop_child(up)


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for its parent does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False
