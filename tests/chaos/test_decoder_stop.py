"""A decoder SIGSTOPped in the middle of answers, streamed and whole.

A stopped process keeps its connections open and says nothing: the gateway notices
only when ``timeouts.decode`` passes without a byte. Then a stream goes on on the
other decoder and a whole answer starts over there; its health checks time out, so
new requests avoid it. Once it is continued, nothing of what the gateway gave up on
may still run on it.
"""

from __future__ import annotations

import signal

import anyio
import pytest

from pd_orchestrator.children import Child

from ..conftest import GatewayFactory, SimFactory
from .harness import Tally, jobs, kill, mid_answer, recoveries, run_jobs, settle, start_fleet

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("stream", [True, False], ids=["mid-stream", "mid-whole-answer"])
async def test_a_decoder_stopped_mid_answer(
    sim_factory: SimFactory, gateway_factory: GatewayFactory, reference: Child, stream: bool
) -> None:
    timeouts = {
        "decode_attempt": 3.0,
        "decode": 3.0,
    }  # a healthy decoder on a busy machine stays within
    fleet = start_fleet(sim_factory, gateway_factory, reference, timeouts=timeouts)
    victim = fleet.decoders[0]
    tally = Tally(f"decoder SIGSTOP {'mid-stream' if stream else 'mid-whole-answer'}")

    async def fault() -> None:
        await mid_answer(victim)
        kill(victim, signal.SIGSTOP)

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(fault)
            await run_jobs(fleet, jobs(12, max_tokens=64, stream=stream), tally)
    finally:
        kill(victim, signal.SIGCONT)
    tally.notes |= await recoveries(fleet)
    tally.check(max_clean_errors=0)
    assert tally.notes["recovered" if stream else "retried"] >= 1
    await settle(fleet.upstreams)  # the continued decoder too: the gateway closed its legs
