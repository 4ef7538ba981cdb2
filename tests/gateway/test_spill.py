"""A prefill pool that spills: ``goodput`` serves a request whole on a prefiller when
the decoders are crowded, or when the routing picks that prefiller and it would
prefill the prompt itself. Simulators and the gateway as real processes."""

from __future__ import annotations

import uuid
from typing import Any

import httpx
import pytest

from pd_orchestrator.children import Child

from ..conftest import GatewayFactory, SimFactory
from .helpers import MODEL, call, metric, metrics_text

pytestmark = pytest.mark.anyio


# Requests in flight rank the instances, and of two as busy the decoder wins on its
# hardware label (the prefill pool is labelled mi325x, in the decoder's group): no tie
# is left to the prompt's hash, and no reading that reaches the gateway sooner from
# one idle simulator than from the other decides.
ROUTING = {
    "decode": {
        "scorers": [
            {"type": "queue-depth", "weight": 1.0},
            {
                "type": "hardware-weight",
                "weight": 0.5,
                "params": {"weights": {"h200": 1.0}, "default": 0.0},
            },
        ]
    }
}


def _pool(name: str, role: str, children: list[Child], **extra: Any) -> dict[str, Any]:
    endpoints = [{"name": f"{name}-{i}", "url": c.url} for i, c in enumerate(children)]
    return (
        {"name": name, "role": role, "hardware": "h200", "model": "sim-model"}
        | extra
        | {"endpoints": endpoints}
    )


async def test_goodput_serves_a_stream_whole_on_a_spilling_prefiller_when_decoders_are_crowded(
    module_sims: SimFactory, module_gateways: GatewayFactory
) -> None:
    sim = ("--profile", "instant", "--kv-connector", "nixl")
    decoder, prefiller = module_sims(*sim, name="decode"), module_sims(*sim, name="prefill")
    reference = module_sims("--profile", "instant", name="reference")
    # A TPOT target no step meets: once the gateway has timed one stream, every
    # decoder is crowded, and the prefiller (no stream timed there) is not.
    policy = {"type": "goodput", "params": {"tpot": 1e-9, "probe_tokens": []}}
    config = {
        "pools": [
            _pool("decode", "decode", [decoder]),
            _pool("prefill", "prefill", [prefiller], spill=True, hardware="mi325x", group="h200"),
        ],
        "threshold": {"policy": policy},
        "routing": ROUTING,
        "health": {"interval": 0.5},
    }
    gateway = module_gateways(config)
    prompt = f"{uuid.uuid4().hex} " + "a long enough prompt for several blocks. " * 4
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "ignore_eos": True}
    first = await call(gateway.url, "completion", body | {"stream": True})
    assert first.status == 200 and first.headers["x-pd-decoder"] == "decode-0"
    # A whole answer first: it times no stream on the prefiller, so the prefiller's step
    # stays below the decoder's for the streamed one after it (without a hardware
    # profile a step is the pool's observed ITL, and two timed streams would tie at
    # random).
    whole = await call(gateway.url, "completion", body)
    assert whole.status == 200 and whole.headers["x-pd-decoder"] == "prefill-0"
    second = await call(gateway.url, "completion", body | {"stream": True})
    assert second.status == 200 and second.decision == "decode"
    assert second.headers["x-pd-decoder"] == "prefill-0"
    assert "x-pd-prefiller" not in second.headers  # served whole: no P/D leg
    expected = await call(reference.url, "completion", body)
    assert first.text == second.text == whole.text == expected.text
    text = await metrics_text(gateway.url)
    assert (
        metric(text, "pd_orchestrator_threshold_decisions_total", policy="goodput", reason="spill")
        == 2
    )


async def test_goodput_serves_a_request_whole_on_the_spilling_prefiller_the_routing_picks(
    module_sims: SimFactory, module_gateways: GatewayFactory
) -> None:
    sim = ("--profile", "h200-llama3-8b", "--model", MODEL, "--kv-connector", "nixl")
    decoder, prefiller = module_sims(*sim, name="decode-r"), module_sims(*sim, name="prefill-r")
    reference = module_sims("--profile", "instant", name="reference-r")
    config = {
        "pools": [
            _pool("decode", "decode", [decoder]),
            _pool("prefill", "prefill", [prefiller], spill=True, hardware="mi325x", group="h200"),
        ],
        # no decoder is crowded or queued; no start-up timing (rates from traffic)
        "threshold": {"policy": {"type": "goodput", "params": {"probe_tokens": []}}},
        "routing": ROUTING,
        "health": {"interval": 0.5},
    }
    gateway = module_gateways(config)
    long = {"model": MODEL, "prompt": f"{uuid.uuid4().hex} a story.", "max_tokens": 200,
            "ignore_eos": True, "stream": True}  # fmt: skip
    body = {"model": MODEL, "prompt": f"{uuid.uuid4().hex} a question.", "max_tokens": 8}
    async with (
        httpx.AsyncClient(base_url=gateway.url, timeout=30) as client,
        client.stream("POST", "/v1/completions", json=long) as response,
    ):
        assert response.headers["x-pd-decoder"] == "decode-0"  # a tie: the decoder
        # while it streams, the spilling prefiller has the shallower queue, and is idle
        other = await call(gateway.url, "completion", body)
        await response.aread()
    assert other.headers["x-pd-decoder"] == "prefill-0"
    assert "x-pd-prefiller" not in other.headers  # served whole: no P/D leg
    expected = await call(reference.url, "completion", body)
    assert other.status == 200 and other.text == expected.text
    text = await metrics_text(gateway.url)
    spills = metric(text, "pd_orchestrator_threshold_decisions_total", policy="goodput",
                    reason="spill")  # fmt: skip
    assert spills == 1
