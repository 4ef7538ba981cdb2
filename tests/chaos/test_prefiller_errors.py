"""A prefiller that answers HTTP 500 to a share of its prefills (``--failure-rate``).

Its health checks pass, so only what requests see can take it out: beside a healthy
peer, failed prefills are sent again there and, when it fails every time, outlier
detection ejects it. Alone, a failed prefill is retried on it (at most
``upstream.prefill_attempts`` times) and then the decoder prefills itself (or, with
the fallback off, the request ends with one clean error).
"""

from __future__ import annotations

import pytest

from pd_orchestrator.children import Child

from ..conftest import GatewayFactory, SimFactory
from .harness import PEERS, PREFILLER, prefill_fault

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize(
    ("rate", "peer"),
    [(1.0, PEERS[0]), (0.3, PEERS[0]), (0.5, PEERS[1]), (0.5, PEERS[2])],
    ids=["always-with-a-peer", "30%-with-a-peer", "50%-alone", "50%-no-fallback"],
)
async def test_a_prefiller_answering_500s(
    sim_factory: SimFactory,
    gateway_factory: GatewayFactory,
    reference: Child,
    rate: float,
    peer: str,
) -> None:
    victim = (*PREFILLER, "--failure-rate", str(rate), "--seed", "7")
    # Which prefiller a cold prompt tries first is a hash of the prompt: with 24 of
    # them, the chance that fewer than 3 try the failing one first is 2 in 10,000.
    always = rate == 1.0
    tally = await prefill_fault(
        sim_factory, gateway_factory, reference, f"500 on {rate:.0%} of prefills", peer, victim,
        count=24 if always else 12, upstream={"retry_backoff": 0.0},
        outlier={"consecutive_5xx": 3 if always else 5},
    )  # fmt: skip
    if always:
        assert tally.notes["ejections"] >= 1  # three 500s in a row: taken out of routing
    if peer != PEERS[2]:
        assert tally.identical == tally.requests
