"""A slow prefiller: every prefill waits before it starts (``--response-delay``).

Slower than ``timeouts.prefill`` allows, its prefills time out: beside a healthy
peer they go there; alone the decoders prefill themselves once
``upstream.prefill_budget`` is spent (or, with the fallback off, each ends with one
clean error). Within the timeout it is only slow: nothing is retried.
"""

from __future__ import annotations

import pytest

from pd_orchestrator.children import Child

from ..conftest import GatewayFactory, SimFactory
from .harness import PEERS, PREFILLER, prefill_fault

pytestmark = pytest.mark.anyio

TIMEOUTS = {"prefill": 1.5, "decode_attempt": 4.0, "decode": 4.0}


@pytest.mark.parametrize(
    ("delay", "peer"),
    [(0.5, PEERS[1]), (3.0, PEERS[0]), (3.0, PEERS[1]), (3.0, PEERS[2])],
    ids=["within-the-timeout-alone", "beyond-with-a-peer", "beyond-alone", "beyond-no-fallback"],
)
async def test_a_slow_prefiller(
    sim_factory: SimFactory,
    gateway_factory: GatewayFactory,
    reference: Child,
    delay: float,
    peer: str,
) -> None:
    victim = (*PREFILLER, "--response-delay", str(delay))
    fault = f"{delay:g} s slow ({'beyond' if delay > TIMEOUTS['prefill'] else 'within'} timeout)"
    tally = await prefill_fault(
        sim_factory, gateway_factory, reference, fault, peer, victim,
        timeouts=TIMEOUTS, upstream={"prefill_budget": 4.0},
    )  # fmt: skip
    if delay < TIMEOUTS["prefill"]:
        assert tally.identical == tally.requests
        assert tally.notes["fell_back"] == tally.notes["retried"] == 0
    elif peer == PEERS[1]:
        assert tally.notes["fell_back"] >= 1
    elif peer == PEERS[2]:
        assert tally.clean_errors == tally.requests  # every request needed a prefill
