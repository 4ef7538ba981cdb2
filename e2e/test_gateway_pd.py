"""The decode-first gateway against a target pair (see targets.py): P/D, warm turns, hand-back."""

from __future__ import annotations

import asyncio
import json
import random
import uuid
from typing import Any

import httpx
import pytest
from targets import Target, metric

pytestmark = pytest.mark.timeout(300)
WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike".split()


def _text_of(url: str, model: str, tokens: int, seed: str) -> str:
    """A text prompt of about ``tokens`` tokens on ``url``'s tokenizer."""
    rng = random.Random(seed)
    words = [rng.choice(WORDS) for _ in range(tokens)]
    while True:
        text = f"{seed} " + " ".join(words)
        count = httpx.post(f"{url}/tokenize", json={"model": model, "prompt": text}, timeout=30)
        n = count.json()["count"]
        if n <= tokens or len(words) < 2:
            return text
        words = words[: max(1, len(words) * tokens // n - 1)]


def _post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=180)


def _reference(target: Target, body: dict[str, Any], path: str = "/v1/completions") -> list[int]:
    plain = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    plain |= {"return_token_ids": True, "temperature": 0, "cache_hit_threshold": 0}
    answer = _post(target.reference, path, plain)
    assert answer.status_code == 200, answer.text
    return list(answer.json()["choices"][0]["token_ids"])


def _ids(answer: dict[str, Any]) -> list[int]:
    return list(answer["choices"][0]["token_ids"])


def test_cold_prompt_goes_pd_and_the_decoder_pulls_the_kv(target: Target, gateway: str) -> None:
    decoder = target.decoders[0]
    prompt = _text_of(target.reference, target.model, 200, uuid.uuid4().hex)
    body = {
        "model": target.model,
        "prompt": prompt,
        "max_tokens": 16,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    hits = metric(decoder, "vllm:external_prefix_cache_hits_total")
    pulls = metric(decoder, "vllm:nixl_xfer_time_seconds_count")
    answer = _post(gateway, "/v1/completions", body)
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-pd-decision"] == "pd"
    assert answer.headers["x-pd-prefiller"].startswith("prefill-")
    assert metric(decoder, "vllm:external_prefix_cache_hits_total") > hits
    assert metric(decoder, "vllm:nixl_xfer_time_seconds_count") > pulls
    assert _ids(answer.json()) == _reference(target, body)


def test_second_turn_is_admitted_and_the_prefiller_sees_nothing(
    target: Target, gateway: str
) -> None:
    history = _text_of(target.reference, target.model, 160, uuid.uuid4().hex)
    messages = [{"role": "user", "content": history}]
    body = {"model": target.model, "messages": messages, "max_tokens": 24, "temperature": 0}
    body |= {"ignore_eos": True}
    turn1 = _post(gateway, "/v1/chat/completions", body)
    assert turn1.status_code == 200, turn1.text
    assert turn1.headers["x-pd-decision"] == "pd"
    reply = turn1.json()["choices"][0]["message"]["content"]
    messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "And?"}]
    prefiller = target.prefillers[0]
    before = metric(prefiller, "vllm:prompt_tokens_total")
    turn2 = _post(gateway, "/v1/chat/completions", body | {"messages": messages, "stream": True})
    assert turn2.status_code == 200
    assert turn2.headers["x-pd-decision"] == "decode"
    assert "data: [DONE]" in turn2.text
    assert metric(prefiller, "vllm:prompt_tokens_total") == before


LOGPROB_LISTS = ("tokens", "text_offset")
"""The completions logprobs lists :func:`_completion_answer` joins."""


async def _completion_answer(
    client: httpx.AsyncClient, gateway: str, body: dict[str, Any]
) -> dict[str, Any]:
    """Token ids, text, logprob tokens and offsets and usage (None: not sent) of a
    completions answer, streamed (the pieces joined) or whole."""
    if not body.get("stream"):
        answer = await client.post(f"{gateway}/v1/completions", json=body)
        assert answer.status_code == 200, answer.text
        whole = answer.json()
        return _parts([whole["choices"][0]], whole.get("usage"))
    choices: list[dict[str, Any]] = []
    usage = None
    async with client.stream("POST", f"{gateway}/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                choices += chunk["choices"]
                usage = chunk.get("usage") or usage
    return _parts(choices, usage)


def _parts(choices: list[dict[str, Any]], usage: dict[str, Any] | None) -> dict[str, Any]:
    parts: dict[str, Any] = {"ids": [], "text": "", "usage": usage,
                             **{name: [] for name in LOGPROB_LISTS}}  # fmt: skip
    for choice in choices:
        parts["ids"] += choice.get("token_ids") or []
        parts["text"] += choice.get("text") or ""
        for name in LOGPROB_LISTS:
            parts[name] += (choice.get("logprobs") or {}).get(name) or []
    return parts


async def _generate(client: httpx.AsyncClient, gateway: str, body: dict[str, Any]) -> list[int]:
    return list((await _completion_answer(client, gateway, body))["ids"])


def _preemption_shape(target: Target) -> tuple[int, int, int]:
    """(prompts, prompt tokens, output tokens) that overflow the decoder's KV cache."""
    if target.name == "vllm":  # 24 blocks of 32 tokens
        return 3, 161, 300
    return 4, 220, 150  # the simulated decoder: 64 blocks of 16 tokens


async def _round(target: Target, gateway: str, stream: bool, index: int) -> list[bool]:
    count, prompt_tokens, output = _preemption_shape(target)
    rng = random.Random(uuid.uuid4().hex)
    # Token prompts: exact sizes make the KV arithmetic of _preemption_shape hold.
    prompts = [[rng.randrange(1000, 3000) for _ in range(prompt_tokens)] for _ in range(count)]
    bodies = [
        {
            "model": target.model,
            "prompt": p,
            "max_tokens": output,
            "ignore_eos": True,
            "temperature": 0,
            "return_token_ids": True,
            "cache_hit_threshold": 0.9,
            "stream": stream,
        }
        for p in prompts
    ]
    async with httpx.AsyncClient(timeout=300) as client:
        for body in bodies:  # P/D once: every prompt is then warm on the decoder
            once = body | {"max_tokens": 1, "stream": False}
            warm = await client.post(f"{gateway}/v1/completions", json=once)
            assert warm.status_code == 200
            assert warm.json()["choices"][0]["finish_reason"] == "length"
        before = metric(gateway, "pd_orchestrator_handbacks_total")
        results = await asyncio.gather(*(_generate(client, gateway, b) for b in bodies))
        handed_back = metric(gateway, "pd_orchestrator_handbacks_total") > before
    for body, ids in zip(bodies, results, strict=True):
        assert ids == _reference(target, body), f"round {index}: output differs from reference"
    return [handed_back]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_preempted_requests_resume_through_the_prefiller_identically(
    target: Target, gateway: str, stream: bool
) -> None:
    if not target.preemption:
        pytest.skip("this target's decoder cannot be forced to preempt (PDO_E2E_PREEMPTION=1)")
    decoder = target.decoders[0]
    rejections = metric(decoder, "vllm:cache_threshold_rejections_total", phase="preemption")
    for index in range(6):
        if any(asyncio.run(_round(target, gateway, stream, index))):
            break
    else:
        pytest.fail("no hand-back happened in 6 rounds")
    after = metric(decoder, "vllm:cache_threshold_rejections_total", phase="preemption")
    assert after > rejections
