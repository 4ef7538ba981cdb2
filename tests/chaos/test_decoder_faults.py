"""Decoders that answer what no vLLM would: the gateway bounds what they cost.

* One that answers ``cache_threshold`` even at threshold 0 (``--always-reject``):
  every leg the gateway sends it at threshold 0 -- the attempt when the threshold is
  0, the decode leg after a prefill otherwise -- is its protocol error. With every
  decoder like that, each request ends with one clean 502 within seconds, after at
  most two upstream requests per decoder (read from the decoders' own counters), and
  outlier detection counts the faults (at threshold 0 nothing in between resets the
  count: the decoder is ejected).
* One that breaks the protocol (``--protocol-fault``): content after the finish
  reason, token ids that are not integers, ``choices`` that is not a list, a finish
  reason that is not a string, a choice numbered 7, an event past the line limit.
  Beside a healthy decoder every request ends identical to the reference (retried
  before its first byte, recovered after it), and the faulty decoder's legs are
  counted as protocol errors.
"""

from __future__ import annotations

import anyio
import pytest

from pd_orchestrator.children import Child
from pd_orchestrator.sim.faults import PROTOCOL_FAULTS

from ..conftest import GatewayFactory, SimFactory
from .harness import (
    DECODER,
    Tally,
    client,
    gateway_metric,
    jobs,
    recoveries,
    run_jobs,
    send,
    settle,
    sim_metric,
    start_fleet,
)

pytestmark = pytest.mark.anyio

ROTATE = {"decode": {"scorers": [], "picker": {"type": "max-score", "params": {"ties": "rotate"}}}}
"""Requests take turns on the decoders: some start on the faulty one."""
REQUESTS = 4
ANSWER_BOUND = 30.0
"""Seconds a request to a fleet of rejecting decoders may take to be answered."""


@pytest.mark.parametrize("threshold", [0.0, 0.5], ids=["at-the-attempt", "after-a-prefill"])
async def test_decoders_that_reject_at_threshold_0_get_one_clean_502_per_request(
    sim_factory: SimFactory, gateway_factory: GatewayFactory, reference: Child, threshold: float
) -> None:
    rejecting = (*DECODER, "--always-reject")
    fleet = start_fleet(
        sim_factory, gateway_factory, reference, decoders=[rejecting, rejecting],
        threshold={"policy": {"type": "static", "value": threshold}},
        outlier={"consecutive_failures": 2, "max_ejection_percent": 50},
    )  # fmt: skip
    async with client() as http:
        for job in jobs(REQUESTS, max_tokens=8):
            with anyio.fail_after(ANSWER_BOUND):
                answer = await send(http, fleet.url, job)
            assert answer.status == 502, answer
            assert answer.error["error"]["code"] == 502, answer.error
            assert answer.error["error"]["type"], answer.error
    legs = 0.0
    for decoder in fleet.decoders:
        # per request at most an attempt and, after a prefill, its decode leg
        sent = await sim_metric(decoder, "vllm:cache_threshold_rejections_total")
        assert 1 <= sent <= 2 * REQUESTS
        legs += sent
    faults = await gateway_metric(
        fleet, "pd_orchestrator_upstream_requests_total", outcome="protocol"
    )
    if threshold == 0.0:  # every leg was a fault: the first decoder to be spared is ejected
        assert faults == legs
        assert await gateway_metric(fleet, "pd_orchestrator_ejections_total") == 1
    else:  # the attempts' rejections were right, the decode legs' faults
        assert faults == legs / 2
    await settle(fleet.upstreams)


@pytest.mark.parametrize("fault", PROTOCOL_FAULTS)
async def test_a_decoder_that_breaks_the_protocol(
    sim_factory: SimFactory, gateway_factory: GatewayFactory, reference: Child, fault: str
) -> None:
    fleet = start_fleet(
        sim_factory, gateway_factory, reference,
        decoders=[(*DECODER, "--protocol-fault", fault), DECODER], routing=ROTATE,
    )  # fmt: skip
    tally = Tally(f"decoder protocol fault: {fault}")
    stream = True if fault == "tokens-after-finish" else None  # a stream's own fault
    await run_jobs(fleet, jobs(8, max_tokens=16, stream=stream), tally, concurrency=4)
    tally.notes |= await recoveries(fleet)
    tally.notes["protocol"] = await gateway_metric(
        fleet, "pd_orchestrator_upstream_requests_total", upstream="decode-0", outcome="protocol"
    )
    tally.check(max_clean_errors=0)
    assert tally.notes["protocol"] >= 1
    await settle(fleet.upstreams)
