"""A prefiller SIGKILLed while prefills are in flight (each takes 0.3 s).

Beside a healthy peer, the prefills it held and the ones after go to the peer (a
decode leg that could not pull the KV it had prefilled starts over on the other
decoder, with the peer). Alone, the decoders prefill themselves
(``upstream.prefill_fallback: local``); with that fallback off, each request that
needed it ends with one clean error.
"""

from __future__ import annotations

import pytest

from pd_orchestrator.children import Child

from ..conftest import GatewayFactory, SimFactory
from .harness import PEERS, PREFILLER, Fleet, kill, prefill_fault, wait_prefilled

pytestmark = pytest.mark.anyio


async def _kill_after_first_prefill(fleet: Fleet) -> None:
    await wait_prefilled(fleet.prefillers[0])
    kill(fleet.prefillers[0])


@pytest.mark.parametrize("peer", PEERS)
async def test_a_prefiller_killed_mid_prefill(
    sim_factory: SimFactory, gateway_factory: GatewayFactory, reference: Child, peer: str
) -> None:
    victim = (*PREFILLER, "--response-delay", "0.3")
    tally = await prefill_fault(
        sim_factory, gateway_factory, reference, "SIGKILL mid-prefill", peer, victim,
        _kill_after_first_prefill,
    )  # fmt: skip
    if peer == PEERS[0]:
        assert tally.notes["fell_back"] == 0
    elif peer == PEERS[1]:
        assert tally.notes["fell_back"] >= 1
    else:
        assert tally.clean_errors >= 1
