"""Requests a continuation cannot honour (tools, structured outputs, logprobs) against a
target pair: sent admission-only with the policy's threshold, a cold one goes P/D with
its constraint on the decode leg, a warm one is admitted, a preempted one is recomputed
by its decoder and never handed back; every answer is the reference's (greedy)."""

from __future__ import annotations

import asyncio
import json
import random
import time
import uuid
from typing import Any

import httpx
import pytest
from targets import METRICS_SECONDS, Target, metric
from test_gateway_pd import _generate, _post, _preemption_shape, _reference, _text_of

pytestmark = pytest.mark.timeout(900)

SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string", "enum": ["yes", "no", "maybe"]}},
    "required": ["answer"],
    "additionalProperties": False,
}
TOOL = {
    "type": "function",
    "function": {"name": "verdict", "description": "Give a verdict.", "parameters": SCHEMA},
}
CONSTRAINTS: dict[str, dict[str, Any]] = {
    "named-tool": {"tools": [TOOL], "tool_choice": {"type": "function",
                                                     "function": {"name": "verdict"}}},
    "json-schema": {"response_format": {"type": "json_schema",
                                        "json_schema": {"name": "verdict", "schema": SCHEMA}}},
}  # fmt: skip


def _admission_only_known(gateway: str, timeout: float = 60.0) -> None:
    """Until the gateway has read that the decoder takes admission-only thresholds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = httpx.get(f"{gateway}/status", timeout=10).json()
        loads = [e["load"] for e in status["endpoints"] if e["role"] == "decode"]
        if loads and all(load and load["admission_only"] for load in loads):
            return
        time.sleep(0.2)
    pytest.fail("the gateway never read vllm:cache_threshold_admission_only from the decoder")


def _answer_of(body: dict[str, Any]) -> tuple[list[int], str]:
    """Token ids and what the constraint shaped: the tool call's arguments or the content."""
    choice = body["choices"][0]
    message = choice["message"]
    calls = message.get("tool_calls") or []
    shaped = calls[0]["function"]["arguments"] if calls else (message.get("content") or "")
    return list(choice["token_ids"]), shaped


@pytest.mark.parametrize("constraint", list(CONSTRAINTS))
def test_a_cold_constrained_request_goes_pd_and_a_warm_one_decode(
    target: Target, gateway: str, constraint: str
) -> None:
    _admission_only_known(gateway)
    decoder, prefiller = target.decoders[0], target.prefillers[0]
    text = _text_of(target.reference, target.model, 160, uuid.uuid4().hex)
    body = {"model": target.model, "messages": [{"role": "user", "content": text}],
            "max_tokens": 24, "temperature": 0, "return_token_ids": True}  # fmt: skip
    body |= CONSTRAINTS[constraint]
    hits = metric(decoder, "vllm:external_prefix_cache_hits_total")
    prefilled = metric(prefiller, "vllm:prompt_tokens_total")
    if constraint == "named-tool" and target.name == "live":
        probe = _post(target.reference, "/v1/chat/completions", body | {"max_tokens": 1})
        if probe.status_code == 400 and "tool-call-parser" in probe.text:
            pytest.skip("the target's servers run no tool-call parser (--tool-call-parser)")
    cold = _post(gateway, "/v1/chat/completions", body)
    assert cold.status_code == 200, cold.text
    assert cold.headers["x-pd-decision"] == "pd"
    assert metric(decoder, "vllm:external_prefix_cache_hits_total") > hits
    assert metric(prefiller, "vllm:prompt_tokens_total") > prefilled
    reference = _post(target.reference, "/v1/chat/completions", body | {"cache_hit_threshold": 0})
    assert reference.status_code == 200, reference.text
    assert _answer_of(cold.json()) == _answer_of(reference.json())
    if target.name == "vllm":  # its constrained JSON ends (no free whitespace): valid
        verdict = json.loads(_answer_of(cold.json())[1])
        assert verdict["answer"] in ("yes", "no", "maybe") and set(verdict) == {"answer"}
    warm = _post(gateway, "/v1/chat/completions", body)
    assert warm.status_code == 200 and warm.headers["x-pd-decision"] == "decode"
    assert _answer_of(warm.json()) == _answer_of(cold.json())
    text_metrics = httpx.get(f"{gateway}/metrics", timeout=METRICS_SECONDS).text
    assert "pd_orchestrator_constrained_requests_total" in text_metrics


async def _preempted_round(target: Target, gateway: str, extra: dict[str, Any]) -> bool:
    """Token prompts that overflow the decoder's KV, warmed (P/D once), then together:
    True when the decoder preempted one. Every answer must be the reference's."""
    count, prompt_tokens, output = _preemption_shape(target)
    rng = random.Random(uuid.uuid4().hex)
    prompts = [[rng.randrange(1000, 3000) for _ in range(prompt_tokens)] for _ in range(count)]
    bodies = [{"model": target.model, "prompt": p, "max_tokens": output, "ignore_eos": True,
               "temperature": 0, "return_token_ids": True} | extra for p in prompts]  # fmt: skip
    decoder = target.decoders[0]
    async with httpx.AsyncClient(timeout=300) as client:
        for body in bodies:
            once = body | {"max_tokens": 1}
            warm = await client.post(f"{gateway}/v1/completions", json=once)
            assert warm.status_code == 200, warm.text
            assert warm.headers["x-pd-decision"] == "pd"
        preempted = metric(decoder, "vllm:num_preemptions_total")
        results = await asyncio.gather(*(_generate(client, gateway, b) for b in bodies))
        preempted_now = metric(decoder, "vllm:num_preemptions_total") > preempted
    for body, ids in zip(bodies, results, strict=True):
        assert ids == _reference(target, body), "the output differs from the reference"
    return preempted_now


@pytest.mark.parametrize("extra", [{"logprobs": 2}], ids=["logprobs"])
def test_a_preempted_constrained_request_is_recomputed_by_its_decoder(
    target: Target, gateway: str, extra: dict[str, Any]
) -> None:
    if not target.preemption:
        pytest.skip("this target's decoder cannot be forced to preempt (PDO_E2E_PREEMPTION=1)")
    _admission_only_known(gateway)
    decoder = target.decoders[0]
    handbacks = metric(gateway, "pd_orchestrator_handbacks_total")
    rejected = metric(decoder, "vllm:cache_threshold_rejections_total", phase="preemption")
    for _ in range(4):
        if asyncio.run(_preempted_round(target, gateway, extra)):
            break
    else:
        pytest.fail("the decoder preempted nothing in 4 rounds")
    assert metric(gateway, "pd_orchestrator_handbacks_total") == handbacks
    after = metric(decoder, "vllm:cache_threshold_rejections_total", phase="preemption")
    assert after == rejected
