"""The request path's accounting: rotation per request, legs in flight, ties that spread."""

from __future__ import annotations

import uuid
from collections import Counter
from typing import Any

import anyio
import httpx
import pytest

from pd_orchestrator.children import Child

from ..conftest import GatewayFactory, SimFactory, gateway_config
from .helpers import MODEL, call

pytestmark = pytest.mark.anyio
INSTANT = ("--profile", "instant", "--kv-connector", "nixl")
ROUND_ROBIN = {
    "decode": {"scorers": [], "picker": {"type": "max-score", "params": {"ties": "rotate"}}}
}


async def _in_flight(gateway: Child, name: str) -> int:
    async with httpx.AsyncClient(base_url=gateway.url, timeout=5) as client:
        status = (await client.get("/status")).json()
    return int(next(e["in_flight"] for e in status["endpoints"] if e["name"] == name))


async def test_round_robin_over_four_decoders_is_a_round_robin(
    sim_factory: SimFactory, gateway_factory: GatewayFactory
) -> None:
    decoders = [sim_factory(*INSTANT, name=f"decode-{i}") for i in range(4)]
    prefiller = sim_factory(*INSTANT, name="prefill")
    config = gateway_config(
        decoders, [prefiller], threshold={"policy": {"value": 0.0}}, routing=ROUND_ROBIN
    )
    gateway = gateway_factory(config)
    served: Counter[str] = Counter()
    body = {"model": MODEL, "prompt": "a short prompt", "max_tokens": 1}
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:
        for _ in range(400):
            response = await client.post("/v1/completions", json=body)
            assert response.status_code == 200
            served[response.headers["x-pd-decoder"]] += 1
    assert set(served) == {f"decode-{i}" for i in range(4)}
    assert all(abs(count - 100) <= 5 for count in served.values()), served


async def test_a_streamed_leg_is_in_flight_while_it_streams(
    sim_factory: SimFactory, gateway_factory: GatewayFactory
) -> None:
    slow = ("--profile", "h200-llama3-8b", "--model", MODEL, "--time-scale", "1.0")
    decoder = sim_factory(*slow, "--kv-connector", "nixl", name="decoder")
    prefiller = sim_factory(*INSTANT, name="prefill")
    gateway = gateway_factory(
        gateway_config([decoder], [prefiller], threshold={"policy": {"value": 0.0}})
    )
    body = {"model": MODEL, "prompt": "stream me", "max_tokens": 300, "ignore_eos": True}
    for leave_early in (False, True):
        async with (
            httpx.AsyncClient(base_url=gateway.url, timeout=30) as client,
            client.stream("POST", "/v1/completions", json=body | {"stream": True}) as response,
        ):
            lines = response.aiter_lines()
            async for line in lines:
                if line.startswith("data: {"):
                    break
            assert await _in_flight(gateway, "decode-0") == 1
            if not leave_early:
                async for _ in lines:
                    pass
        with anyio.fail_after(10):  # released when done, and when the client left
            while await _in_flight(gateway, "decode-0") != 0:  # noqa: ASYNC110 - another process
                await anyio.sleep(0.05)


async def test_cold_ask_all_requests_one_after_another_spread(
    sim_factory: SimFactory, gateway_factory: GatewayFactory
) -> None:
    decoders = [sim_factory(*INSTANT, name=f"decode-{i}") for i in range(4)]
    prefiller = sim_factory(*INSTANT, name="prefill")
    config = gateway_config(decoders, [prefiller], threshold={"policy": {"value": 0.9}})
    config |= {"mode": "ask-all"}
    gateway = gateway_factory(config)
    served: list[str] = []
    for _ in range(6):
        conversation = f"{uuid.uuid4().hex} " + "a cold conversation opens here. " * 6
        body: dict[str, Any] = {
            "model": MODEL,
            "messages": [{"role": "user", "content": conversation}],
            "max_tokens": 2,
        }
        answer = await call(gateway.url, "chat", body)
        assert answer.status == 200 and answer.decision == "pd"
        served.append(answer.headers["x-pd-decoder"])
    counts = Counter(served)
    assert len(counts) == 4 and max(counts.values()) == 2, served
