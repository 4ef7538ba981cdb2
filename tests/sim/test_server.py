"""The simulator's HTTP surface, against real processes on loopback."""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import pytest

from pd_orchestrator.children import Child
from pd_orchestrator.sim.tokenizer import SimTokenizer

from ..conftest import SimFactory

pytestmark = pytest.mark.anyio
MODEL = "sim-model"


@pytest.fixture(scope="module")
def sim(module_sims: SimFactory) -> Child:
    return module_sims("--profile", "instant", "--block-size", "16")


async def _post(url: str, path: str, body: Any, **headers: str) -> httpx.Response:
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        return await client.post(path, json=body, headers=headers)


async def _stream_events(url: str, path: str, body: dict[str, Any]) -> list[str]:
    async with (
        httpx.AsyncClient(base_url=url, timeout=10) as client,
        client.stream("POST", path, json=body) as response,
    ):
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        text = (await response.aread()).decode()
    assert text.endswith("\n\n")
    events = [e for e in text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    return [e[len("data: ") :] for e in events]


def _metric(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} {labels} not found")


async def _metrics(url: str) -> str:
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        return (await client.get("/metrics")).text


# -- answers ------------------------------------------------------------------------------------


async def test_completion_answer_carries_text_ids_and_usage(sim: Child) -> None:
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 5, "return_token_ids": True}
    data = (await _post(sim.url, "/v1/completions", body)).json()
    choice = data["choices"][0]
    assert data["object"] == "text_completion"
    assert choice["finish_reason"] == "length"
    assert len(choice["token_ids"]) == 5
    prompt_ids = SimTokenizer().encode("Once upon a time")
    assert choice["prompt_token_ids"] == prompt_ids
    assert SimTokenizer().decode(choice["token_ids"]) == choice["text"]
    usage = data["usage"]
    assert usage["prompt_tokens"] == len(prompt_ids) and usage["completion_tokens"] == 5
    assert usage["total_tokens"] == len(prompt_ids) + 5
    again = (await _post(sim.url, "/v1/completions", body)).json()
    assert again["choices"][0]["text"] == choice["text"]


async def test_token_prompt_continues_exactly_where_a_text_prompt_stopped(sim: Child) -> None:
    base = {"model": MODEL, "max_tokens": 12, "ignore_eos": True, "return_token_ids": True}
    full = (await _post(sim.url, "/v1/completions", base | {"prompt": "a story"})).json()
    ids = full["choices"][0]["prompt_token_ids"] + full["choices"][0]["token_ids"][:5]
    rest = (await _post(sim.url, "/v1/completions", base | {"prompt": ids, "max_tokens": 7})).json()
    assert rest["choices"][0]["token_ids"] == full["choices"][0]["token_ids"][5:]


async def test_chat_answer_and_warm_second_turn(sim: Child) -> None:
    turn1 = [{"role": "system", "content": "x" * 300}, {"role": "user", "content": "hello"}]
    body = {"model": MODEL, "messages": turn1, "max_tokens": 20, "ignore_eos": True}
    first = (await _post(sim.url, "/v1/chat/completions", body)).json()
    message = first["choices"][0]["message"]
    assert first["object"] == "chat.completion" and message["role"] == "assistant"
    turn2 = [*turn1, message, {"role": "user", "content": "more"}]
    second = (await _post(sim.url, "/v1/chat/completions", body | {"messages": turn2})).json()
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= first["usage"]["prompt_tokens"] + 20 - 16


async def test_streams_match_the_whole_answer(sim: Child) -> None:
    body = {"model": MODEL, "prompt": "stream me", "max_tokens": 6, "ignore_eos": True}
    whole = (await _post(sim.url, "/v1/completions", body)).json()["choices"][0]["text"]
    events = await _stream_events(
        sim.url,
        "/v1/completions",
        body | {"stream": True, "stream_options": {"include_usage": True}},
    )
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    usage = chunks.pop()
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 6
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 5 + ["length"]


async def test_chat_stream_opens_with_a_role_only_chunk(sim: Child) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3,
        "stream": True,
        "return_token_ids": True,
    }
    events = await _stream_events(sim.url, "/v1/chat/completions", body)
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[0]["object"] == "chat.completion.chunk"
    assert "prompt_token_ids" in chunks[0]
    assert all("content" in c["choices"][0]["delta"] for c in chunks[1:])
    assert sum(len(c["choices"][0]["token_ids"]) for c in chunks[1:]) == 3


async def test_threshold_rejection_shapes(sim: Child) -> None:
    body = {"model": MODEL, "prompt": "cold cold cold " * 10, "max_tokens": 4}
    body["cache_hit_threshold"] = 0.5
    data = (await _post(sim.url, "/v1/completions", body)).json()
    assert data["choices"][0]["finish_reason"] == "cache_threshold"
    assert data["usage"]["completion_tokens"] == 0 and data["choices"][0]["text"] == ""
    events = await _stream_events(
        sim.url,
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "another cold prompt " * 5}],
            "cache_hit_threshold": 0.9,
            "stream": True,
        },
    )
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "cache_threshold"
    assert chunks[-1]["choices"][0]["delta"] == {}


async def test_forced_rejection_header(sim: Child) -> None:
    body = {"model": MODEL, "prompt": "anything", "max_tokens": 2}
    response = await _post(
        sim.url, "/v1/completions", body, **{"X-Cache-Threshold-Finish-Reason": "true"}
    )
    assert response.json()["choices"][0]["finish_reason"] == "cache_threshold"


# -- bad input ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "hi"}, "model"),
        ({"model": MODEL, "prompt": "hi", "max_tokens": "many"}, "max_tokens"),
        ({"model": MODEL, "prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ({"model": MODEL, "prompt": "hi", "n": 2}, "n"),
        ({"model": MODEL, "prompt": "hi", "cache_hit_threshold": 1.5}, "cache_hit_threshold"),
        ({"model": MODEL, "prompt": "hi", "cache_hit_threshold": -0.1}, "cache_hit_threshold"),
        ({"model": MODEL, "prompt": ""}, "prompt"),
        ({"model": MODEL, "prompt": [1, 10**9]}, "prompt"),
        ({"model": MODEL, "prompt": 7}, "prompt"),
        ({"model": MODEL, "prompt": "hi", "cache_hit_admission_only": "yes"},
         "cache_hit_admission_only"),
        ({"model": MODEL, "prompt": "hi", "vllm_xargs": {"cache_hit_admission_only": 2}},
         "vllm_xargs"),
    ],
    ids=[
        "missing-model",
        "max-tokens-type",
        "max-tokens-zero",
        "n-2",
        "threshold-high",
        "threshold-negative",
        "empty-prompt",
        "token-out-of-vocab",
        "prompt-type",
        "admission-only-body",
        "admission-only-xargs",
    ],
)  # fmt: skip
async def test_bad_requests_get_400_in_vllm_error_shape(
    sim: Child, body: dict[str, Any], param: str
) -> None:
    response = await _post(sim.url, "/v1/completions", body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "BadRequestError" and error["code"] == 400
    assert error["param"] == param and error["message"]


async def test_malformed_json_and_unknown_model(sim: Child) -> None:
    async with httpx.AsyncClient(base_url=sim.url, timeout=10) as client:
        bad = await client.post("/v1/chat/completions", content=b"{not json")
        unknown = await client.post("/v1/completions", json={"model": "other", "prompt": "x"})
    assert bad.status_code == 400 and "malformed JSON" in bad.json()["error"]["message"]
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "model"


# -- other routes --------------------------------------------------------------------------------


async def test_models_health_tokenize_detokenize(sim: Child) -> None:
    async with httpx.AsyncClient(base_url=sim.url, timeout=10) as client:
        models = (await client.get("/v1/models")).json()
        health = await client.get("/health")
        tokens = (await client.post("/tokenize", json={"prompt": "héllo"})).json()
        text = (await client.post("/detokenize", json={"tokens": tokens["tokens"]})).json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert health.status_code == 200
    assert tokens["count"] == len("héllo".encode()) and text["prompt"] == "héllo"


async def test_metrics_move_with_traffic(sim: Child) -> None:
    before = await _metrics(sim.url)
    prompt = "metrics prompt " * 8  # 120 tokens, 7 full blocks below the last token
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
    await _post(sim.url, "/v1/completions", body)
    await _post(sim.url, "/v1/completions", body)
    await _post(
        sim.url, "/v1/completions", body | {"prompt": "cold " * 9, "cache_hit_threshold": 1}
    )
    after = await _metrics(sim.url)

    def delta(name: str, **labels: str) -> float:
        return _metric(after, name, **labels) - _metric(before, name, **labels)

    assert delta("vllm:prefix_cache_queries_total") == 120 * 2 + 45
    assert delta("vllm:prefix_cache_hits_total") == 112
    assert delta("vllm:generation_tokens_total") == 4
    assert delta("vllm:request_success_total", finished_reason="length") == 2
    assert delta("vllm:cache_threshold_rejections_total", phase="admission") == 1
    assert _metric(after, "vllm:num_requests_running") == 0
    assert re.search(r'^vllm:kv_cache_usage_perc\{.*model_name="sim-model"', after, re.M)


async def test_forced_error_status(sim: Child) -> None:
    body = {"model": MODEL, "prompt": "x"}
    response = await _post(sim.url, "/v1/completions", body, **{"X-Return-Error": "503"})
    assert response.status_code == 503
    assert response.json()["error"]["type"] == "ServiceUnavailableError"


async def test_dropped_stream_breaks_the_connection(sim: Child) -> None:
    body = {"model": MODEL, "prompt": "x", "max_tokens": 20, "ignore_eos": True, "stream": True}
    received = []
    with pytest.raises(httpx.RemoteProtocolError):
        async with (
            httpx.AsyncClient(base_url=sim.url, timeout=10) as client,
            client.stream(
                "POST", "/v1/completions", json=body, headers={"X-Drop-After-Tokens": "3"}
            ) as response,
        ):
            async for line in response.aiter_lines():
                if line.startswith("data: {"):
                    received.append(line)
    assert len(received) == 3
