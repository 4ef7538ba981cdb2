"""Connector variants, sidecar mode, failures and client disconnects."""

from __future__ import annotations

import socket
from pathlib import Path

import anyio
import httpx
import pytest

from pd_orchestrator.sim.generation import advance_all, initial_state, next_token
from pd_orchestrator.sim.tokenizer import EOS_TOKEN_ID, SimTokenizer

from ..conftest import GatewayFactory, SimFactory, gateway_config
from .helpers import MODEL, call, metric, metrics_text

pytestmark = pytest.mark.anyio
NIXL = ("--profile", "instant", "--kv-connector", "nixl")
PROMPT = "a prompt that is long enough to span several blocks of the cache. " * 3


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _prompt_ending_on_first_token() -> str:
    root = initial_state(0, MODEL)
    tokenizer = SimTokenizer()
    for i in range(20_000):
        prompt = f"{PROMPT}#{i}"
        if next_token(advance_all(root, tokenizer.encode(prompt)), allow_eos=True) == EOS_TOKEN_ID:
            return prompt
    raise AssertionError("no such prompt")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_prefill_that_finishes_is_the_answer(
    sim_factory: SimFactory, gateway_factory: GatewayFactory, stream: bool
) -> None:
    decoder, prefiller = sim_factory(*NIXL), sim_factory(*NIXL)
    gateway = gateway_factory(gateway_config([decoder], [prefiller]))
    body = {"model": MODEL, "prompt": _prompt_ending_on_first_token(), "max_tokens": 8}
    answer = await call(gateway.url, "completion", body | {"stream": stream})
    assert answer.status == 200 and answer.decision == "pd"
    assert answer.finish_reason == "stop" and answer.text == ""
    assert answer.usage is None or answer.usage["completion_tokens"] == 1
    decoder_text = await metrics_text(decoder.url)
    assert metric(decoder_text, "vllm:generation_tokens_total") == 0  # no decode leg ran


async def test_shared_storage_connector(
    sim_factory: SimFactory, gateway_factory: GatewayFactory, tmp_path: Path
) -> None:
    shared = ("--profile", "instant", "--kv-connector", "example", "--kv-shared-dir", str(tmp_path))
    decoder, prefiller = sim_factory(*shared), sim_factory(*shared)
    reference = sim_factory("--profile", "instant")
    gateway = gateway_factory(gateway_config([decoder], [prefiller], connector="example"))
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 10, "ignore_eos": True}
    answer = await call(gateway.url, "completion", body)
    assert answer.decision == "pd" and answer.usage is not None
    assert answer.usage["prompt_tokens_details"]["cached_tokens"] > 0  # loaded from storage
    assert answer.text == (await call(reference.url, "completion", body)).text


async def test_prefiller_down_is_a_clear_5xx_without_the_local_fallback(
    sim_factory: SimFactory, gateway_factory: GatewayFactory
) -> None:
    decoder = sim_factory(*NIXL)
    config = gateway_config([decoder], [])
    config["prefillers"] = [{"name": "gone", "url": f"http://127.0.0.1:{_free_port()}"}]
    config["upstream"] = {"prefill_attempts": 2, "retry_backoff": 0.01, "prefill_fallback": "error"}
    gateway = gateway_factory(config)
    for stream in (False, True):
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "stream": stream}
        answer = await call(gateway.url, "completion", body)
        assert answer.status == 502
        assert answer.body is not None
        assert "prefiller gone is unavailable during prefill" in answer.body["error"]["message"]
        assert "127.0.0.1" not in answer.body["error"]["message"]


async def test_prefiller_down_falls_back_to_the_decoder_alone(
    sim_factory: SimFactory, gateway_factory: GatewayFactory
) -> None:
    decoder, reference = sim_factory(*NIXL), sim_factory("--profile", "instant")
    config = gateway_config([decoder], [])
    config["prefillers"] = [{"name": "gone", "url": f"http://127.0.0.1:{_free_port()}"}]
    config["upstream"] = {"prefill_attempts": 2, "retry_backoff": 0.01}
    gateway = gateway_factory(config)
    for stream in (False, True):  # a cold prompt each time: the decoder rejects it first
        body = {"model": MODEL, "prompt": f"{stream} {PROMPT}", "max_tokens": 6, "ignore_eos": True}
        expected = await call(reference.url, "completion", body)
        answer = await call(gateway.url, "completion", body | {"stream": stream})
        assert answer.status == 200 and answer.decision == "decode"
        assert "x-pd-prefiller" not in answer.headers
        assert answer.text == expected.text
    text = await metrics_text(gateway.url)
    assert metric(text, "pd_orchestrator_upstream_errors_total", kind="fell_back") == 2


async def test_decoder_down_is_a_503(
    sim_factory: SimFactory, gateway_factory: GatewayFactory
) -> None:
    prefiller = sim_factory(*NIXL)
    config = gateway_config([], [prefiller])
    config["decoders"] = [{"name": "gone", "url": f"http://127.0.0.1:{_free_port()}"}]
    gateway = gateway_factory(config)
    answer = await call(gateway.url, "completion", {"model": MODEL, "prompt": PROMPT})
    assert answer.status == 503
    async with httpx.AsyncClient(base_url=gateway.url, timeout=5) as client:
        assert (await client.get("/ready")).status_code == 503


async def test_sidecar_allow_list(sim_factory: SimFactory, gateway_factory: GatewayFactory) -> None:
    decoder, allowed, other = sim_factory(*NIXL), sim_factory(*NIXL), sim_factory(*NIXL)
    allowed_hp, other_hp = allowed.url.removeprefix("http://"), other.url.removeprefix("http://")
    config = gateway_config([decoder], [])
    config["sidecar"] = {"enabled": True, "allowed_prefillers": [allowed_hp]}
    gateway = gateway_factory(config)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4}
    header = "x-prefiller-host-port"
    refused = await call(gateway.url, "completion", body, {header: other_hp})
    assert refused.status == 403 and refused.body is not None
    assert "allow-list" in refused.body["error"]["message"]
    served = await call(gateway.url, "completion", body, {header: allowed_hp})
    assert served.status == 200 and served.decision == "pd"
    assert served.headers["x-pd-prefiller"] == allowed_hp
    assert metric(await metrics_text(other.url), "vllm:prompt_tokens_total") == 0
    cold = {"prompt": "an entirely different and cold prompt " * 4}
    no_prefiller = await call(gateway.url, "completion", body | cold)  # llm-d chose decode-only
    assert no_prefiller.status == 200 and no_prefiller.decision == "decode"


async def test_client_disconnect_cancels_the_upstream_request(
    sim_factory: SimFactory, gateway_factory: GatewayFactory
) -> None:
    slow = ("--profile", "h200-llama3-8b", "--model", MODEL, "--kv-connector", "nixl")
    decoder, prefiller = sim_factory(*slow), sim_factory(*slow)
    gateway = gateway_factory(gateway_config([decoder], [prefiller]))
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 5000, "ignore_eos": True}
    async with (
        httpx.AsyncClient(base_url=gateway.url, timeout=10) as client,
        client.stream("POST", "/v1/completions", json=body | {"stream": True}) as response,
    ):
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                break
    assert metric(await metrics_text(decoder.url), "vllm:num_requests_running") <= 1
    with anyio.fail_after(5):
        while metric(await metrics_text(decoder.url), "vllm:num_requests_running") > 0:  # noqa: ASYNC110
            await anyio.sleep(0.05)
    with anyio.fail_after(5):  # the same for a non-streamed request
        async with httpx.AsyncClient(base_url=gateway.url, timeout=0.5) as client:
            with pytest.raises(httpx.ReadTimeout):
                await client.post("/v1/completions", json=body)
        while metric(await metrics_text(decoder.url), "vllm:num_requests_running") > 0:  # noqa: ASYNC110
            await anyio.sleep(0.05)


async def test_a_decoder_no_prefiller_can_reach_prefills_itself_or_is_a_clear_503(
    sim_factory: SimFactory, gateway_factory: GatewayFactory
) -> None:
    both, reference = sim_factory(*NIXL), sim_factory("--profile", "instant")
    pool = {"name": "flex", "role": "both", "hardware": "h200", "model": MODEL}
    config = {
        "pools": [pool | {"endpoints": [{"name": "both-0", "url": both.url}]}],
        "threshold": {"policy": {"type": "static", "params": {"value": 1.0}}},  # always P/D
        "health": {"interval": 0.5},
    }
    gateway = gateway_factory(config)
    for stream in (False, True):
        body = {"model": MODEL, "prompt": f"{stream} {PROMPT}", "max_tokens": 6, "ignore_eos": True}
        expected = await call(reference.url, "completion", body)
        answer = await call(gateway.url, "completion", body | {"stream": stream})
        assert answer.status == 200 and answer.decision == "decode"
        assert answer.text == expected.text
    strict = gateway_factory(config | {"upstream": {"prefill_fallback": "error"}})
    answer = await call(strict.url, "completion", {"model": MODEL, "prompt": PROMPT})
    assert answer.status == 503 and answer.body is not None
    assert "no prefiller can hand KV over to decoder both-0" in answer.body["error"]["message"]
