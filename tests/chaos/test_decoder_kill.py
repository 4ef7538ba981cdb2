"""A decoder SIGKILLed in the middle of answers, streamed and whole.

A stream whose decoder dies is continued on the other decoder (prompt plus the
tokens the client got, through the prefiller); a whole answer was not sent yet, so
it starts over there. Every request ends identical to the reference.
"""

from __future__ import annotations

import anyio
import pytest

from pd_orchestrator.children import Child

from ..conftest import GatewayFactory, SimFactory
from .harness import Tally, jobs, kill, mid_answer, recoveries, run_jobs, settle, start_fleet

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("stream", [True, False], ids=["mid-stream", "mid-whole-answer"])
async def test_a_decoder_killed_mid_answer(
    sim_factory: SimFactory, gateway_factory: GatewayFactory, reference: Child, stream: bool
) -> None:
    fleet = start_fleet(sim_factory, gateway_factory, reference)
    victim = fleet.decoders[0]
    tally = Tally(f"decoder SIGKILL {'mid-stream' if stream else 'mid-whole-answer'}")

    async def fault() -> None:
        await mid_answer(victim)
        kill(victim)

    async with anyio.create_task_group() as tg:
        tg.start_soon(fault)
        await run_jobs(fleet, jobs(12, max_tokens=64, stream=stream), tally)
    tally.notes |= await recoveries(fleet)
    tally.check(max_clean_errors=0)
    # the fault hit answers in flight: streams went on elsewhere, whole answers started over
    assert tally.notes["recovered" if stream else "retried"] >= 1
    await settle(fleet.decoders[1:] + fleet.prefillers)
