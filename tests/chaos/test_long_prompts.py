"""Long prompts from a client: their size must not get a healthy decoder ejected.

Prefilling a 16k-token prompt takes these decoders about 3 s, three times the read
timeouts the gateway has here. The read timeout of every leg grows with the prompt
(``timeouts.per_1k_prompt_tokens``, 0.5 s per 1,000 tokens by default), so the
decoders are given the time the request's own size needs: every request is served,
identical to the reference, with no timeout and no ejection. (Without it each
request timed out on every decoder in turn, and outlier detection ejected one.)
"""

from __future__ import annotations

import uuid

import pytest

from pd_orchestrator.children import Child
from pd_orchestrator.sim.tokenizer import NUM_WORDS, WORD_BASE

from ..conftest import GatewayFactory, SimFactory
from .harness import (
    MODEL,
    NIXL,
    Job,
    Tally,
    gateway_metric,
    run_jobs,
    settle,
    start_fleet,
)

pytestmark = pytest.mark.anyio

TOKENS = 16_000
SLOW = ("--profile", "h200-llama3-8b", "--time-scale", "5", *NIXL)
"""A decoder that prefills 16k tokens in about 3 s."""
TIMEOUTS = {"connect": 1.0, "decode_attempt": 1.0, "prefill": 1.0, "decode": 1.0}


def _long_jobs(count: int) -> list[Job]:
    """``count`` cold prompts of :data:`TOKENS` token ids (counted exactly)."""
    start = uuid.uuid4().int % NUM_WORDS
    made = []
    for i in range(count):
        first = (start + i * 7919) % NUM_WORDS
        prompt = [WORD_BASE + (first + k * 31) % NUM_WORDS for k in range(TOKENS)]
        body = {
            "model": MODEL,
            "prompt": prompt,
            "max_tokens": 8,
            "ignore_eos": True,
            "temperature": 0,
            "return_token_ids": True,
            "stream": i % 2 == 0,
        }
        made.append(Job("completion", body))
    return made


async def test_long_prompts_neither_time_out_nor_get_a_decoder_ejected(
    sim_factory: SimFactory, gateway_factory: GatewayFactory, reference: Child
) -> None:
    fleet = start_fleet(
        sim_factory, gateway_factory, reference, decoders=[SLOW, SLOW],
        threshold={"policy": {"type": "static", "value": 0.0}}, timeouts=TIMEOUTS,
        outlier={"consecutive_failures": 2, "max_ejection_percent": 50},
    )  # fmt: skip
    tally = Tally(f"{TOKENS}-token prompts, 1 s read timeouts")
    await run_jobs(fleet, _long_jobs(4), tally, concurrency=2)
    tally.notes["timeouts"] = await gateway_metric(
        fleet, "pd_orchestrator_upstream_requests_total", outcome="timeout"
    )
    tally.notes["ejections"] = await gateway_metric(fleet, "pd_orchestrator_ejections_total")
    tally.check(max_clean_errors=0)
    assert tally.notes["timeouts"] == tally.notes["ejections"] == 0
    await settle(fleet.upstreams)
