"""Live reload: SIGHUP and the authenticated admin endpoint, without disturbing requests."""

from __future__ import annotations

import logging
import signal
import uuid
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
import yaml

from pd_orchestrator.bench.fleet import preset_fleet
from pd_orchestrator.bench.live import _gateway_config
from pd_orchestrator.children import Child, python_command, start_child, stop_child
from pd_orchestrator.config import GatewayConfig
from pd_orchestrator.config.loader import parse_config
from pd_orchestrator.config.settings import TimeoutConfig, UpstreamConfig
from pd_orchestrator.gateway.state import (
    GatewayState,
    build_state,
    goodput_knowledge,
    restart_notes,
)
from pd_orchestrator.gateway.status import status_document
from pd_orchestrator.policies.goodput import GoodputPolicy
from pd_orchestrator.policies.goodput_model import GoodputModel
from pd_orchestrator.telemetry.metrics import GatewayMetrics
from pd_orchestrator.upstream.client import Upstream

from ..conftest import SimFactory, gateway_config
from .helpers import MODEL, call, metric, metrics_text

pytestmark = pytest.mark.anyio
TOKEN = "s3cret-token"


class Served:
    def __init__(self, path: Path, config: dict[str, Any], child: Child) -> None:
        self.path, self.config, self.child = path, config, child

    def rewrite(self, **changes: Any) -> None:
        self.path.write_text(yaml.safe_dump(self.config | changes))


@pytest.fixture
def served(sim_factory: SimFactory, tmp_path: Path) -> Any:
    nixl = ("--profile", "h200-llama3-8b", "--model", MODEL, "--kv-connector", "nixl")
    decoder, prefiller = sim_factory(*nixl), sim_factory(*nixl)
    config = gateway_config([decoder], [prefiller], threshold={"policy": {"value": 0.5}})
    config["admin"] = {"token": TOKEN}
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump(config))
    child = start_child("gateway", python_command("serve", "--config", str(path), "--port", "0"))
    try:
        yield Served(path, config, child)
    finally:
        stop_child(child)


async def _reload(url: str, token: str | None = TOKEN) -> httpx.Response:
    headers = {"authorization": f"Bearer {token}"} if token else {}
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        return await client.post("/admin/reload", headers=headers)


def _body(prompt: str) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 4, "ignore_eos": True}


async def test_admin_reload_applies_a_new_threshold(served: Served) -> None:
    url = served.child.url
    prompt = f"{uuid.uuid4().hex} " + "a prompt that will be warm. " * 6
    assert (await call(url, "completion", _body(prompt))).decision == "pd"
    near = prompt + " and a tail of new words that lowers the hit ratio"
    assert (await call(url, "completion", _body(near))).decision == "decode"  # ratio >= 0.5
    served.rewrite(threshold={"policy": {"value": 0.99}})
    response = await _reload(url)
    assert response.status_code == 200 and response.json()["reloaded"] is True
    other = near + " and yet another tail of words"
    assert (await call(url, "completion", _body(other))).decision == "pd"  # ratio < 0.99


async def test_an_invalid_config_is_refused_and_the_old_one_stays(served: Served) -> None:
    url = served.child.url
    served.path.write_text(yaml.safe_dump(served.config | {"thresold": {"value": 1}}))
    response = await _reload(url)
    assert response.status_code == 422
    assert "thresold: unknown key" in response.json()["error"]["message"]
    answer = await call(url, "completion", _body(f"{uuid.uuid4().hex} still serving"))
    assert answer.status == 200
    text = await metrics_text(url)
    assert metric(text, "pd_orchestrator_config_reloads_total", result="refused") == 1


async def test_the_admin_api_needs_the_token(served: Served) -> None:
    assert (await _reload(served.child.url, token=None)).status_code == 401
    assert (await _reload(served.child.url, token="wrong")).status_code == 401


async def test_sighup_reloads(served: Served) -> None:
    served.rewrite(threshold={"policy": {"value": 0.9}})
    served.child.process.send_signal(signal.SIGHUP)
    with anyio.fail_after(5):
        while True:
            text = await metrics_text(served.child.url)
            try:
                if metric(text, "pd_orchestrator_config_reloads_total", result="applied") == 1:
                    break
            except AssertionError:
                pass
            await anyio.sleep(0.05)


async def test_in_flight_streams_survive_a_reload(served: Served) -> None:
    url = served.child.url
    body = _body(f"{uuid.uuid4().hex} a long answer") | {"max_tokens": 200, "stream": True}
    async with (
        httpx.AsyncClient(base_url=url, timeout=30) as client,
        client.stream("POST", "/v1/completions", json=body) as response,
    ):
        lines = response.aiter_lines()
        first = [line async for line in _take(lines, 3)]
        served.rewrite(
            threshold={"policy": {"value": 0.1}},
            routing={"decode": {"scorers": [{"type": "kv-usage"}]}},
        )
        assert (await _reload(url)).status_code == 200
        rest = [line async for line in lines]
    events = [line for line in [*first, *rest] if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert not any('"error"' in line for line in events)
    assert len(events) - 1 == 200  # every token, nothing lost or repeated


async def _take(lines: Any, count: int) -> Any:
    taken = 0
    async for line in lines:
        yield line
        if line.startswith("data: "):
            taken += 1
            if taken == count:
                return


def test_a_reload_names_the_changes_only_a_restart_applies() -> None:
    base = GatewayConfig.model_validate(
        {
            "decoders": [{"name": "d", "url": "http://127.0.0.1:1"}],
            "prefillers": [{"name": "p", "url": "http://127.0.0.1:2"}],
        }
    )

    def changed(**update: dict[str, Any]) -> GatewayConfig:
        data = base.model_dump(mode="json")
        for key, values in update.items():
            data[key] = data[key] | values
        return GatewayConfig.model_validate(data)

    assert restart_notes(base, base) == ""
    applied = changed(upstream={"api_key": "k", "decode_attempts": 2}, limits={"max_json_depth": 8})
    assert restart_notes(base, applied) == ""
    notes = restart_notes(
        base, changed(upstream={"max_connections": 8}, tracing={"sample_ratio": 0.5})
    )
    assert notes == "upstream connection pool, tracing changes take effect at restart"
    assert "timeouts" in restart_notes(base, changed(timeouts={"decode": 5.0}))


async def test_a_reload_keeps_what_the_goodput_model_learnt() -> None:
    """Like the fleet's health, the cost model's learnt state (rates, duty cycles, hit
    rates, means) survives a reload of a policy of the same name; its parameters are
    the new configuration's."""
    fleet = preset_fleet("tiny")
    urls = {i.name: f"http://127.0.0.1:{9000 + n}" for n, i in enumerate(fleet.instances)}

    def state(params: dict[str, Any], previous: GatewayState | None = None) -> GatewayState:
        threshold = {"policy": {"type": "goodput", "name": "cost", "params": params}}
        config = parse_config(_gateway_config(fleet, urls, threshold, {}))
        return build_state(config, upstream, GatewayMetrics(), lambda: 0.0, previous)

    def model(state: GatewayState) -> GoodputModel:
        resolver = state.planner.threshold
        assert resolver is not None and isinstance(resolver.policy, GoodputPolicy)
        return resolver.policy.model

    upstream = Upstream(UpstreamConfig(), TimeoutConfig())
    try:
        before = state({"ttft": 1.0})
        model(before).out_mean, model(before).hits["d0"] = 321.0, 0.5
        after = state({"ttft": 2.0}, before)
        assert (model(after).out_mean, model(after).hits) == (321.0, {"d0": 0.5})
        assert model(after).params.ttft == 2.0
        renamed = parse_config(_gateway_config(fleet, urls, {"policy": {"type": "goodput"}}, {}))
        fresh = build_state(renamed, upstream, GatewayMetrics(), lambda: 0.0, after)
        assert model(fresh).out_mean == 0.0  # another policy: nothing to keep
    finally:
        await upstream.aclose()


async def test_the_gateway_says_per_pool_what_goodput_starts_from(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """No silent knowledge: a pool that names a built-in simulator profile is said to
    run on it; a real endpoint whose pool names none starts from the seeds, even
    with a hardware label the simulator's table has (``h200``). The start-up log,
    ``/status`` and the ``pd_orchestrator_policy_knowledge`` gauge say which."""
    fleet = preset_fleet("tiny")
    urls = {i.name: f"http://127.0.0.1:{9000 + n}" for n, i in enumerate(fleet.instances)}
    data = _gateway_config(fleet, urls, {"policy": {"type": "goodput"}}, {})
    bare, named = data["pools"][0], data["pools"][1]
    assert bare["hardware"] == "h200" and named["profile"] == "h200-llama3-8b"
    bare["profile"] = None
    config = parse_config(data)
    upstream = Upstream(UpstreamConfig(), TimeoutConfig())
    metrics = GatewayMetrics()
    try:
        with caplog.at_level(logging.INFO, logger="pd_orchestrator.gateway.state"):
            state = build_state(config, upstream, metrics, lambda: 0.0)
        document = status_document(state, 0.0)
    finally:
        await upstream.aclose()
    known = document["goodput_starts_from"]
    assert set(known) == {e["pool"] for e in document["endpoints"]}
    assert known[bare["name"]] == "seeds"
    assert known[named["name"]] == "simulator profile h200-llama3-8b"
    gauge = metrics.registry.get_sample_value
    assert gauge("pd_orchestrator_policy_knowledge", {"pool": bare["name"], "source": "seeds"}) == 1
    labels = {"pool": named["name"], "source": "simulator"}
    assert gauge("pd_orchestrator_policy_knowledge", labels) == 1
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("goodput:")]
    assert len(lines) == len(known)
    assert all(e["cached_counts"] == "unknown" for e in document["endpoints"])
    static = parse_config(_gateway_config(fleet, urls, {"policy": {"value": 0.7}}, {}))
    assert goodput_knowledge(static) == {}
