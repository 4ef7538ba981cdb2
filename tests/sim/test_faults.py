"""The simulator's misbehaviours (``--always-reject``, ``--protocol-fault``), against
real processes on loopback: what a faulty upstream sends, for the gateway's tests."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from ..conftest import SimFactory

pytestmark = pytest.mark.anyio
MODEL = "sim-model"
BODY = {"model": MODEL, "prompt": "any prompt", "max_tokens": 3, "ignore_eos": True,
        "return_token_ids": True}  # fmt: skip


async def _answer(url: str, body: dict[str, Any]) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        response = await client.post("/v1/completions", json=body)
    assert response.status_code == 200
    answer: dict[str, Any] = response.json()
    return answer


async def _chunks(url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        response = await client.post("/v1/completions", json=body | {"stream": True})
    events = [e.removeprefix("data: ") for e in response.text.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


async def test_always_reject_rejects_even_at_threshold_0(sim_factory: SimFactory) -> None:
    sim = sim_factory("--profile", "instant", "--always-reject")
    answer = await _answer(sim.url, BODY | {"cache_hit_threshold": 0.0})
    assert answer["choices"][0]["finish_reason"] == "cache_threshold"
    assert answer["usage"]["completion_tokens"] == 0


async def test_protocol_faults(sim_factory: SimFactory) -> None:
    async def faulty(fault: str) -> str:
        return sim_factory("--profile", "instant", "--protocol-fault", fault, name=fault).url

    chunks = await _chunks(await faulty("tokens-after-finish"), BODY)
    finished = [i for i, c in enumerate(chunks) if c["choices"][0]["finish_reason"]]
    assert finished == [2]
    assert chunks[3]["choices"][0]["token_ids"] and chunks[3]["choices"][0]["text"]
    answer = await _answer(await faulty("token-ids-type"), BODY)
    assert answer["choices"][0]["token_ids"] and all(
        isinstance(t, str) for t in answer["choices"][0]["token_ids"]
    )
    answer = await _answer(await faulty("choices-type"), BODY)
    assert isinstance(answer["choices"], dict) and answer["choices"]["finish_reason"] == "length"
    chunks = await _chunks(await faulty("finish-reason-type"), BODY)
    assert chunks[-1]["choices"][0]["finish_reason"] == 1
