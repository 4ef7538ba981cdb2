"""The OpenAI surface beyond completions: /tokenize, /detokenize, /version, and
Authorization -- the gateway's own client keys, the client's key forwarded upstream,
or a pool's key instead (simulators started with vLLM's ``--api-key``)."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from pd_orchestrator import __version__
from pd_orchestrator.children import Child, python_command, start_child, stop_child

from ..conftest import GatewayFactory, SimFactory, gateway_config
from .helpers import MODEL, call, metric, metrics_text

pytestmark = pytest.mark.anyio
INSTANT = ("--profile", "instant", "--kv-connector", "nixl")


def _cold() -> dict[str, Any]:
    prompt = f"{uuid.uuid4().hex} " + "a prompt long enough for a few blocks. " * 4
    return {"model": MODEL, "prompt": prompt, "max_tokens": 4, "ignore_eos": True}


def _is_openai_error(body: dict[str, Any], status: int) -> bool:
    error = body.get("error")
    return (
        isinstance(error, dict)
        and error.get("code") == status
        and isinstance(error.get("message"), str)
        and isinstance(error.get("type"), str)
    )


async def _post(url: str, path: str, body: Any, **headers: str) -> httpx.Response:
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        return await client.post(path, json=body, headers=headers)


async def _get(url: str, path: str, **headers: str) -> httpx.Response:
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        return await client.get(path, headers=headers)


# -- tokenizer routes and version -----------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizing(module_sims: SimFactory, module_gateways: GatewayFactory) -> tuple[Child, Child]:
    decoder = module_sims(*INSTANT, name="decode")
    prefiller = module_sims(*INSTANT, name="prefill")
    return module_gateways(gateway_config([decoder], [prefiller])), decoder


@pytest.mark.parametrize(
    "body",
    [
        {"model": MODEL, "prompt": "The quick brown fox, 42 times."},
        {"prompt": "no model named: any decoder answers"},
        {"model": MODEL, "messages": [{"role": "user", "content": "Hello there!"}]},
    ],
    ids=["prompt", "no-model", "chat"],
)
async def test_tokenize_through_the_gateway_counts_as_the_decoder_does(
    tokenizing: tuple[Child, Child], body: dict[str, Any]
) -> None:
    gateway, decoder = tokenizing
    through = await _post(gateway.url, "/tokenize", body, **{"x-request-id": "tok-1"})
    direct = await _post(decoder.url, "/tokenize", body)
    assert through.status_code == direct.status_code == 200
    assert through.json() == direct.json()
    assert through.json()["count"] == len(through.json()["tokens"]) > 0
    assert through.headers["x-request-id"] == "tok-1"


async def test_detokenize_round_trips(tokenizing: tuple[Child, Child]) -> None:
    gateway, _ = tokenizing
    text = "round trip through the gateway"
    tokens = (await _post(gateway.url, "/tokenize", {"model": MODEL, "prompt": text})).json()
    answer = await _post(gateway.url, "/detokenize", {"model": MODEL, "tokens": tokens["tokens"]})
    assert answer.status_code == 200 and answer.json()["prompt"] == text


@pytest.mark.parametrize(
    ("path", "body", "status"),
    [
        ("/tokenize", {"model": "no-such-model", "prompt": "x"}, 404),
        ("/tokenize", ["not", "an", "object"], 400),
        ("/detokenize", {"model": MODEL, "tokens": [10**9]}, 400),  # the decoder refuses
    ],
    ids=["unknown-model", "not-an-object", "upstream-refusal"],
)
async def test_tokenizer_errors_are_in_the_openai_shape(
    tokenizing: tuple[Child, Child], path: str, body: Any, status: int
) -> None:
    gateway, _ = tokenizing
    response = await _post(gateway.url, path, body)
    assert response.status_code == status
    assert _is_openai_error(response.json(), status), response.json()


async def test_tokenizer_requests_are_counted_apart_from_decisions(
    tokenizing: tuple[Child, Child],
) -> None:
    gateway, _ = tokenizing
    await _post(gateway.url, "/tokenize", {"model": MODEL, "prompt": "count me"})
    text = await metrics_text(gateway.url)
    assert metric(text, "pd_orchestrator_requests_total", route="/tokenize", code="200") >= 1
    assert metric(text, "pd_orchestrator_upstream_requests_total", phase="tokenize") >= 1
    assert 'pd_orchestrator_decisions_total{decision="none"}' not in text


async def test_version_names_the_gateway_and_each_endpoint(tokenizing: tuple[Child, Child]) -> None:
    gateway, _ = tokenizing
    document = (await _get(gateway.url, "/version")).json()
    assert document["version"] == __version__
    sim_version = f"pd-orchestrator-sim {__version__}"
    assert document["upstreams"] == {"decode-0": sim_version, "prefill-0": sim_version}


# -- the gateway's own keys --------------------------------------------------------------------
async def test_client_keys_guard_every_route_but_health_ready_and_metrics(
    sim_factory: SimFactory, gateway_factory: GatewayFactory
) -> None:
    decoder = sim_factory(*INSTANT, name="decode")
    prefiller = sim_factory(*INSTANT, name="prefill")
    auth = {"api_keys": ["gw-key-1", "gw-key-2"]}
    gateway = gateway_factory(gateway_config([decoder], [prefiller], auth=auth))
    url = gateway.url
    refused = [
        await _post(url, "/v1/completions", _cold()),
        await _post(url, "/v1/chat/completions", _cold(), authorization="Bearer wrong"),
        await _post(url, "/tokenize", {"prompt": "x"}, authorization="Basic gw-key-1"),
        await _get(url, "/v1/models", authorization="gw-key-1"),
        await _get(url, "/version"),
        await _get(url, "/status"),
    ]
    for response in refused:
        assert response.status_code == 401
        assert response.headers["www-authenticate"] == "Bearer"
        assert _is_openai_error(response.json(), 401)
    for path in ("/health", "/ready", "/metrics"):
        assert (await _get(url, path)).status_code in (200, 503)  # /ready: 503 until checked
    ok = await call(url, "completion", _cold(), {"authorization": "Bearer gw-key-2"})
    assert ok.status == 200
    models = await _get(url, "/v1/models", authorization="bearer gw-key-1")
    assert models.status_code == 200


# -- keys towards the upstreams ----------------------------------------------------------------
@pytest.fixture
def keyed_sims(sim_factory: SimFactory) -> tuple[Child, Child]:
    """A decoder and a prefiller that want ``Bearer up-key`` on /v1 (vLLM's --api-key)."""
    return (
        sim_factory(*INSTANT, "--api-key", "up-key", name="decode"),
        sim_factory(*INSTANT, "--api-key", "up-key", name="prefill"),
    )


async def test_the_clients_authorization_is_forwarded_to_every_leg(
    keyed_sims: tuple[Child, Child], gateway_factory: GatewayFactory
) -> None:
    decoder, prefiller = keyed_sims
    gateway = gateway_factory(gateway_config([decoder], [prefiller]))
    ok = await call(gateway.url, "completion", _cold(), {"authorization": "Bearer up-key"})
    assert ok.status == 200 and ok.decision == "pd"  # the prefill leg carried it too
    refused = await call(gateway.url, "completion", _cold())
    # the upstream's 401, in the gateway's words (upstream 401/403 map to 502)
    assert refused.status == 502 and _is_openai_error(refused.body or {}, 502)
    assert "(HTTP 401)" in (refused.body or {})["error"]["message"]


def _pools(decoder: Child, prefiller: Child, **pool: Any) -> list[dict[str, Any]]:
    return [
        {"name": "dec", "role": "decode", "model": MODEL, **pool,
         "endpoints": [{"name": "decode-0", "url": decoder.url}]},
        {"name": "pre", "role": "prefill", "model": MODEL, **pool,
         "endpoints": [{"name": "prefill-0", "url": prefiller.url}]},
    ]  # fmt: skip


async def test_a_pools_api_key_replaces_the_clients(
    keyed_sims: tuple[Child, Child], gateway_factory: GatewayFactory
) -> None:
    decoder, prefiller = keyed_sims
    config = {"pools": _pools(decoder, prefiller, api_key="up-key"), "health": {"interval": 0.5}}
    gateway = gateway_factory(config)
    anonymous = await call(gateway.url, "completion", _cold())
    assert anonymous.status == 200 and anonymous.decision == "pd"
    other = await call(gateway.url, "completion", _cold(), {"authorization": "Bearer theirs"})
    assert other.status == 200


async def test_gateway_keys_stay_at_the_gateway_and_the_upstream_key_comes_from_the_environment(
    keyed_sims: tuple[Child, Child], tmp_path: Path
) -> None:
    decoder, prefiller = keyed_sims
    config = {"pools": _pools(decoder, prefiller), "auth": {"api_keys": ["gw-key"]}}
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump(config))
    argv = python_command("serve", "--config", str(path), "--port", "0")
    gateway = start_child("gateway", argv, env={"PDO_UPSTREAM__API_KEY": "up-key"}, timeout=60)
    try:
        answer = await call(gateway.url, "completion", _cold(), {"authorization": "Bearer gw-key"})
        assert answer.status == 200 and answer.decision == "pd"
        checked = await _post(
            gateway.url, "/tokenize", {"prompt": "x"}, authorization="Bearer gw-key"
        )
        assert checked.status_code == 200
    finally:
        stop_child(gateway)
    assert "up-key" not in gateway.log_tail(200)
