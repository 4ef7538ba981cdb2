"""KV leases that expire before the decoder pulls (``--lease-seconds 0``).

The decoder cannot load the prefilled KV and answers 500 before any token. When
another prefiller's KV is good, the request starts over on the other decoder with
that prefiller. When every prefill expires, a decoder whose KV-load failure policy
is ``recompute`` (vLLM's ``kv_load_failure_policy``) prefills itself; with ``fail``
each request ends with one clean error, after both decoders were tried.
"""

from __future__ import annotations

import pytest

from pd_orchestrator.children import Child

from ..conftest import GatewayFactory, SimFactory
from .harness import (
    DECODER,
    PREFILLER,
    Tally,
    jobs,
    recoveries,
    run_jobs,
    settle,
    sim_metric,
    start_fleet,
)

pytestmark = pytest.mark.anyio
EXPIRING = (*PREFILLER, "--lease-seconds", "0")


@pytest.mark.parametrize(
    ("case", "prefillers", "policy"),
    [
        ("one of two prefillers expires", [EXPIRING, PREFILLER], "fail"),
        ("every prefill expires, decoders recompute", [EXPIRING], "recompute"),
        ("every prefill expires, decoders fail", [EXPIRING], "fail"),
    ],
    ids=["one-of-two", "recompute", "fail"],
)
async def test_kv_leases_expired_before_the_pull(
    sim_factory: SimFactory,
    gateway_factory: GatewayFactory,
    reference: Child,
    case: str,
    prefillers: list[tuple[str, ...]],
    policy: str,
) -> None:
    decoder = (*DECODER, "--kv-load-failure-policy", policy)
    fleet = start_fleet(
        sim_factory, gateway_factory, reference, decoders=[decoder, decoder], prefillers=prefillers
    )
    tally = Tally(f"KV lease expired before the pull: {case}")
    await run_jobs(fleet, jobs(12, max_tokens=16), tally)
    tally.notes |= await recoveries(fleet)
    tally.check(max_clean_errors=None if policy == "fail" and len(prefillers) == 1 else 0)
    if case.startswith("one"):
        assert tally.notes["retried"] >= 1  # some decode legs found no KV: started over
    elif policy == "fail":
        assert tally.clean_errors == tally.requests
    else:
        pulled = sum(
            [await sim_metric(d, "vllm:nixl_xfer_time_seconds_count") for d in fleet.decoders]
        )
        assert pulled == 0  # nothing could be pulled: the decoders computed every prompt
    await settle(fleet.upstreams)
