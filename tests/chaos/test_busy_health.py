"""Every endpoint answers its health checks too late (a busy server): routing must not
fail closed.

With every decoder and prefiller marked unhealthy, the routing's ``healthy`` filter
keeps them all (panic routing) and each request's own outcome decides: every
request is served, identical to the reference. (What they answer then counts for
more than their late health checks.)
"""

from __future__ import annotations

import httpx
import pytest

from pd_orchestrator.children import Child

from ..conftest import GatewayFactory, SimFactory
from .harness import DECODER, PREFILLER, Fleet, Tally, jobs, poll, run_jobs, settle, start_fleet

pytestmark = pytest.mark.anyio
SLOW_HEALTH = ("--health-delay", "3")


async def _none_healthy(fleet: Fleet) -> bool:
    async with httpx.AsyncClient(timeout=5) as http:
        status = (await http.get(f"{fleet.url}/status")).json()
    return not any(e["healthy"] for e in status["endpoints"])


async def test_requests_are_served_when_every_endpoint_looks_unhealthy(
    sim_factory: SimFactory, gateway_factory: GatewayFactory, reference: Child
) -> None:
    fleet = start_fleet(
        sim_factory, gateway_factory, reference,
        decoders=[(*DECODER, *SLOW_HEALTH)] * 2, prefillers=[(*PREFILLER, *SLOW_HEALTH)],
        health={"interval": 0.5, "timeout": 0.5},
    )  # fmt: skip
    await poll(lambda: _none_healthy(fleet), 10.0, 0.1)
    tally = Tally("every endpoint's /health too slow (panic routing)")
    await run_jobs(fleet, jobs(12, max_tokens=16), tally)
    tally.check(max_clean_errors=0)  # served although every one of them looked unhealthy
    await settle(fleet.upstreams)
