"""A prefiller SIGSTOPped while prefills are in flight (each takes 0.3 s).

Its prefills time out (``timeouts.prefill``); beside a healthy peer they are sent
again there, alone they are retried within ``upstream.prefill_budget`` and then the
decoders prefill themselves (or, with the fallback off, each ends with one clean
error). A decode leg waiting on KV from it times out and starts over elsewhere.
Once continued, it must not run anything the gateway gave up on.
"""

from __future__ import annotations

import signal

import pytest

from pd_orchestrator.children import Child

from ..conftest import GatewayFactory, SimFactory
from .harness import PEERS, PREFILLER, Fleet, kill, prefill_fault, settle, wait_prefilled

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("peer", PEERS)
async def test_a_prefiller_stopped_mid_prefill(
    sim_factory: SimFactory, gateway_factory: GatewayFactory, reference: Child, peer: str
) -> None:
    stopped: list[Fleet] = []

    async def stop(fleet: Fleet) -> None:
        await wait_prefilled(fleet.prefillers[0])
        kill(fleet.prefillers[0], signal.SIGSTOP)
        stopped.append(fleet)

    victim = (*PREFILLER, "--response-delay", "0.3")
    try:
        tally = await prefill_fault(
            sim_factory, gateway_factory, reference, "SIGSTOP mid-prefill", peer, victim, stop,
            timeouts={"prefill": 1.5, "decode_attempt": 2.0, "decode": 2.0},
            upstream={"prefill_budget": 5.0},
        )  # fmt: skip
    finally:
        for fleet in stopped:
            kill(fleet.prefillers[0], signal.SIGCONT)
    if peer == PEERS[1]:
        assert tally.notes["fell_back"] >= 1
    await settle(stopped[0].upstreams)
