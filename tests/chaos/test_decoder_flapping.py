"""A decoder that keeps crashing and coming back on the same port while requests flow.

Each time it dies, the streams it served go on on the other decoder and the whole
answers start over there; while it is down, requests sent to it are refused and
sent to the other decoder. Refusals in a row eject it (here after 2, for a second
times the number of ejections), and once it is up and its ejection time is over,
a health check brings it back into routing.
"""

from __future__ import annotations

import socket
from functools import partial

import anyio
import httpx
import pytest

from pd_orchestrator.children import Child

from ..conftest import GatewayFactory, SimFactory
from .harness import (
    DECODER,
    PREFILLER,
    Fleet,
    Tally,
    gateway_metric,
    jobs,
    kill,
    poll,
    recoveries,
    run_jobs,
    settle,
    start_fleet,
)

pytestmark = pytest.mark.anyio
FLAPS = 3


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def _in_routing(fleet: Fleet, name: str) -> bool:
    async with httpx.AsyncClient(timeout=5) as http:
        status = (await http.get(f"{fleet.url}/status")).json()
    entry = next(e for e in status["endpoints"] if e["name"] == name)
    return bool(entry["healthy"]) and entry["ejected"] is None


async def test_a_flapping_decoder(
    sim_factory: SimFactory, gateway_factory: GatewayFactory, reference: Child
) -> None:
    port = _free_port()
    flapping = (*DECODER, "--port", str(port))
    outlier = {"consecutive_failures": 2, "base_ejection_time": 1.0, "max_ejection_time": 3.0}
    fleet = start_fleet(
        sim_factory, gateway_factory, reference,
        decoders=[flapping, DECODER], prefillers=[PREFILLER], outlier=outlier,
    )  # fmt: skip
    tally = Tally(f"decoder flapping ({FLAPS} crashes and restarts)")
    current = fleet.decoders[0]

    async def flap() -> None:
        nonlocal current
        for _ in range(FLAPS):
            await anyio.sleep(0.8)
            kill(current)
            await anyio.sleep(0.7)
            # the restart blocks until the simulator is ready: off the event loop
            current = await anyio.to_thread.run_sync(
                partial(sim_factory, *flapping, name="decode-0")
            )

    async with anyio.create_task_group() as tg:
        tg.start_soon(flap)
        await run_jobs(fleet, jobs(36, max_tokens=32), tally, concurrency=6)
    tally.notes |= await recoveries(fleet)
    tally.notes["ejections"] = await gateway_metric(
        fleet, "pd_orchestrator_ejections_total", upstream="decode-0"
    )
    tally.check(max_clean_errors=0)
    assert tally.notes["ejections"] >= 1
    await poll(lambda: _in_routing(fleet, "decode-0"), 20.0, 0.2)  # back once it answers
    await settle([current, *fleet.decoders[1:], *fleet.prefillers])
