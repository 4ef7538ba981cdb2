"""No silent knowledge, end to end: a pool that names a measured profile file runs
``goodput`` from it, one that names none starts from the seeds, and the gateway says
which (``/status``, the knowledge gauge) and what the model learnt since. Simulators
and the gateway as real processes."""

from __future__ import annotations

import uuid
from pathlib import Path

import httpx
import pytest

from pd_orchestrator.model.hardware import PROFILES
from pd_orchestrator.model.measured import Measured, Points, dump_measured

from ..conftest import GatewayFactory, SimFactory
from .helpers import call, metric, metrics_text

pytestmark = pytest.mark.anyio


async def test_a_pool_runs_goodput_from_its_measured_profile_and_the_gateway_says_so(
    sim_factory: SimFactory, gateway_factory: GatewayFactory, tmp_path: Path
) -> None:
    measured = PROFILES["h200-llama3-8b"]
    profile = tmp_path / "measured.yaml"
    dump_measured(Measured(measured, Points(), {"url": "http://decoder"}), profile)
    sim = ("--profile", "instant", "--kv-connector", "nixl")
    decoder, prefiller = sim_factory(*sim, name="decode"), sim_factory(*sim, name="prefill")
    pools = [
        {"name": "decode", "role": "decode", "hardware": "h200", "model": "sim-model",
         "profile": str(profile), "endpoints": [{"name": "d0", "url": decoder.url}]},
        {"name": "prefill", "role": "prefill", "hardware": "h200", "model": "sim-model",
         "endpoints": [{"name": "p0", "url": prefiller.url}]},
    ]  # fmt: skip
    config = {"pools": pools, "threshold": {"policy": {"type": "goodput"}}}
    gateway = gateway_factory(config | {"health": {"interval": 0.5}})
    prompt = f"{uuid.uuid4().hex} " + "a prompt of a few blocks. " * 8
    body = {"model": "sim-model", "prompt": prompt, "max_tokens": 4, "ignore_eos": True}
    answer = await call(gateway.url, "completion", body | {"stream": True})
    assert answer.status == 200
    async with httpx.AsyncClient(timeout=30) as client:
        status = (await client.get(f"{gateway.url}/status")).json()
    assert status["goodput_starts_from"] == {
        "decode": f"measured profile {profile}",
        "prefill": "seeds",  # `hardware: h200` alone picks no simulator constants
    }
    learnt = status["goodput_learnt"]["goodput"]["decode"]
    assert learnt["handover_fixed"] == pytest.approx(measured.a_kv)
    assert learnt["rate_local"] > 0
    assert learnt["step_per_stream"] is None  # a measured profile has the step
    assert learnt["attention"] == pytest.approx(measured.attn)  # and the attention term
    text = await metrics_text(gateway.url)
    knowledge = "pd_orchestrator_policy_knowledge"
    assert metric(text, knowledge, pool="decode", source="measured") == 1
    assert metric(text, knowledge, pool="prefill", source="seeds") == 1
