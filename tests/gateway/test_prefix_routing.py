"""Prefix-aware routing in the gateway: the precise index fed by the decoders' KV events,
and the approximate index learning from the gateway's own decisions."""

from __future__ import annotations

import socket
import uuid
from typing import Any

import anyio
import httpx
import pytest

from pd_orchestrator.children import Child

from ..conftest import GatewayFactory, SimFactory, gateway_config
from .helpers import MODEL, call

pytestmark = pytest.mark.anyio
ROTATE = {"type": "max-score", "params": {"ties": "rotate"}}
UNGUARDED = {"share_slack": None}  # a handful of requests: no share bound to trip


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _document(tag: str) -> str:
    return f"[{tag}] " + "a long shared document about routing and caches. " * 12


async def _follow_ups_stay_warm(gateway: Child) -> None:
    """Four documents, each first served somewhere; every follow-up goes back there.

    ``ignore_eos``: a first token drawn as EOS would end the request on the
    prefiller, leaving the decoder cold (correctly), which is not what this checks.
    """
    for _ in range(4):
        document = _document(uuid.uuid4().hex)
        opening = {"model": MODEL, "prompt": document, "max_tokens": 2, "ignore_eos": True}
        first = await call(gateway.url, "completion", opening)
        assert first.status == 200
        for question in ("What is it about?", "Who wrote it?", "Why?"):
            body = {**opening, "prompt": f"{document}\nQ: {question}"}
            answer = await call(gateway.url, "completion", body)
            assert answer.headers["x-pd-decoder"] == first.headers["x-pd-decoder"], question
            assert answer.decision == "decode"


async def _status(url: str) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=url, timeout=5) as client:
        return dict((await client.get("/status")).json())


async def test_precise_prefix_routing_follows_the_kv_events(
    sim_factory: SimFactory, gateway_factory: GatewayFactory
) -> None:
    ports = [_port(), _port()]
    nixl = ("--profile", "instant", "--kv-connector", "nixl")
    decoders = [
        sim_factory(*nixl, "--kv-events-endpoint", f"tcp://127.0.0.1:{port}") for port in ports
    ]
    prefiller = sim_factory(*nixl)
    config = gateway_config(decoders, [prefiller], threshold={"policy": {"value": 0.5}})
    config["routing"] = {
        "decode": {
            "scorers": [
                {"type": "precise-prefix", "weight": 3, "params": UNGUARDED},
                {"type": "kv-usage", "weight": 2},
            ],
            "picker": ROTATE,
        }
    }
    config["prefix"] = {
        "precise": {
            "block_size": 16,
            "tokenize": True,  # text prompts: the decoder's /tokenize gives the ids
            "events": {
                "publisher": None,
                "endpoints": {
                    f"decode-{i}": {"publisher": f"tcp://127.0.0.1:{port}"}
                    for i, port in enumerate(ports)
                },
            },
        }
    }
    gateway = gateway_factory(config)
    await _follow_ups_stay_warm(gateway)
    status = await _status(gateway.url)
    assert set(status["prefix"]["kv_event_streams"]) == {"decode-0", "decode-1"}
    assert status["prefix"]["index"]["keys"] > 0


async def test_approximate_prefix_routing_learns_from_its_decisions(
    sim_factory: SimFactory, gateway_factory: GatewayFactory
) -> None:
    nixl = ("--profile", "instant", "--kv-connector", "nixl")
    decoders = [sim_factory(*nixl), sim_factory(*nixl)]
    prefiller = sim_factory(*nixl)
    config = gateway_config(decoders, [prefiller], threshold={"policy": {"value": 0.5}})
    config["routing"] = {
        "decode": {
            "scorers": [{"type": "approximate-prefix", "weight": 3, "params": UNGUARDED}],
            "picker": ROTATE,
        }
    }
    gateway = gateway_factory(config)
    await _follow_ups_stay_warm(gateway)
    with anyio.fail_after(5):
        status = await _status(gateway.url)
    assert status["prefix"]["plugin_memory_bytes"]["decode/approximate-prefix"] > 0
