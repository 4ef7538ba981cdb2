"""Clients that leave in every phase of a request.

A client that closes its connection must leave nothing behind: the gateway closes
every leg of its request (closing the connection is how vLLM learns to abort), so
every simulator is soon back to no request running, the gateway counts it as 499
and has nothing in flight; and the requests after it are served identically.

Phases, each caught by watching the gateway rather than by timing: during the
decode attempt (the decoder holds it, nothing was answered yet), during the prefill
(the prefiller holds it), in the middle of a stream (tokens arrived), in the middle
of a whole answer (the decoder is generating it).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import anyio
import httpx
import pytest

from pd_orchestrator.children import Child

from ..conftest import GatewayFactory, SimFactory
from .harness import (
    DECODER,
    PREFILLER,
    Fleet,
    Job,
    Progress,
    Tally,
    gateway_metric,
    jobs,
    poll,
    run_jobs,
    send,
    settle,
    sim_metric,
    start_fleet,
)

pytestmark = pytest.mark.anyio
LEAVERS = 4


async def _in_flight(fleet: Fleet, name: str) -> int:
    async with httpx.AsyncClient(timeout=5) as http:
        status = (await http.get(f"{fleet.url}/status")).json()
    return int(next(e for e in status["endpoints"] if e["name"] == name)["in_flight"])


Phases = dict[str, tuple[bool, Callable[[], Awaitable[bool]]]]


def _phases(fleet: Fleet, progress: Progress, prefilled: list[float]) -> Phases:
    """Phase -> (streamed, when the client leaves); ``prefilled[0]``: prefills the
    prefiller finished before the current request."""

    async def attempting() -> bool:
        decoders = sum([await _in_flight(fleet, f"decode-{i}") for i in range(2)])
        return decoders >= 1 and await _in_flight(fleet, "prefill-0") == 0

    async def prefilling() -> bool:
        return await _in_flight(fleet, "prefill-0") >= 1

    async def streaming() -> bool:
        return progress.tokens >= 3

    async def generating() -> bool:
        done = await sim_metric(fleet.prefillers[0], "vllm:request_success_total")
        decoders = sum([await _in_flight(fleet, f"decode-{i}") for i in range(2)])
        return done > prefilled[0] and decoders >= 1  # past the prefill, decoding

    return {
        "during the decode attempt": (True, attempting),
        "during the prefill": (False, prefilling),
        "mid-stream": (True, streaming),
        "mid-whole-answer": (False, generating),
    }


async def _leave(
    fleet: Fleet, job: Job, when: Callable[[], Awaitable[bool]], progress: Progress
) -> bool:
    """Send ``job`` and close the connection once ``when()``; True if it left before
    the answer ended."""
    async with httpx.AsyncClient(timeout=30) as http, anyio.create_task_group() as tg:
        ended = False

        async def request() -> None:
            nonlocal ended
            await send(http, fleet.url, job, progress)
            ended = True
            tg.cancel_scope.cancel()

        tg.start_soon(request)
        await poll(when, 20.0, 0.01)
        tg.cancel_scope.cancel()  # the client closes its connection
    return not ended


@pytest.mark.parametrize(
    "phase", ["during the decode attempt", "during the prefill", "mid-stream", "mid-whole-answer"]
)
async def test_a_client_that_leaves(
    sim_factory: SimFactory, gateway_factory: GatewayFactory, reference: Child, phase: str
) -> None:
    decoder = (*DECODER, "--response-delay", "0.4")  # each leg waits: phases last long enough
    prefiller = (*PREFILLER, "--response-delay", "0.6")
    fleet = start_fleet(
        sim_factory, gateway_factory, reference, decoders=[decoder, decoder], prefillers=[prefiller]
    )
    progress, prefilled = Progress(), [0.0]
    streamed, when = _phases(fleet, progress, prefilled)[phase]
    left = 0
    for job in jobs(LEAVERS, max_tokens=64, stream=streamed, tag="leaving "):
        progress.tokens = progress.streams_started = 0
        prefilled[0] = await sim_metric(fleet.prefillers[0], "vllm:request_success_total")
        left += await _leave(fleet, job, when, progress)
    await settle(fleet.upstreams)  # nothing of theirs still runs upstream
    await poll(lambda: _gateway_idle(fleet), 10.0, 0.1)
    tally = Tally(f"client disconnect {phase}")
    await run_jobs(fleet, jobs(6, max_tokens=16), tally)  # and the gateway serves on
    tally.notes |= {
        "left": left,
        "answered_499": await gateway_metric(fleet, "pd_orchestrator_requests_total", code="499"),
    }
    tally.check(max_clean_errors=0)
    assert left == LEAVERS and tally.notes["answered_499"] == LEAVERS


async def _gateway_idle(fleet: Fleet) -> bool:
    return await gateway_metric(fleet, "pd_orchestrator_in_flight_requests") == 0
