"""Constrained requests (tools, structured outputs, logprobs) against a target pair: a
cold one goes P/D with its constraint on the decode leg, a warm one is admitted, and
the client's answer, whole or streamed, honours the constraint (a JSON answer or a
tool call's arguments validate against the schema, a tool call keeps one id, usage
counts each token once). Preempted, a structured output or a named tool call is
handed back and continued with its grammar advanced over the tokens already
generated (the plugin's ``cache_hit_resume_tokens``), and the continued answer is
still one valid document; a request a continuation cannot honour (logprobs) is sent
admission-only and recomputed by its decoder, never handed back. Every answer is the
reference's (greedy)."""

from __future__ import annotations

import asyncio
import json
import random
import re
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import jsonschema
import pytest
from targets import METRICS_SECONDS, Target, metric
from test_gateway_pd import (
    LOGPROB_LISTS,
    _completion_answer,
    _generate,
    _post,
    _preemption_shape,
    _reference,
    _text_of,
)

pytestmark = pytest.mark.timeout(900)

PREEMPTION_ROUNDS = 8
"""Rounds of requests that overflow the decoder's KV together before a preemption test
gives up: a round preempts nothing when the requests reach the decoder one after
another (4 rounds once preempted nothing in a whole suite, while the pair's servers
ran in sessions of their own and starved the test's processes for seconds; see
e2e/vllm_cpu/pair.py)."""
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
REGEX = "(yes|no|maybe)!"
CONSTRAINTS: dict[str, dict[str, Any]] = {
    "named-tool": {"tools": [TOOL], "tool_choice": {"type": "function",
                                                     "function": {"name": "verdict"}}},
    "required-tool": {"tools": [TOOL], "tool_choice": "required"},
    "json-schema": {"response_format": {"type": "json_schema",
                                        "json_schema": {"name": "verdict", "schema": SCHEMA}}},
    "structured-json": {"structured_outputs": {"json": SCHEMA}},
    "regex": {"structured_outputs": {"regex": REGEX}},
    "choice": {"structured_outputs": {"choice": ["definitely yes", "definitely not",
                                                 "hard to say"]}},
}  # fmt: skip
TOOL_CHOICES = ("named-tool", "required-tool")


def _admission_only_known(
    gateway: str, capability: str = "admission_only", timeout: float = 60.0
) -> None:
    """Until the gateway has read that the decoders take admission-only thresholds
    (``capability`` ``resumes``: that every endpoint resumes a grammar)."""
    roles = ("decode",) if capability == "admission_only" else ("decode", "prefill")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = httpx.get(f"{gateway}/status", timeout=10).json()
        loads = [e["load"] for e in status["endpoints"] if e["role"] in roles]
        if loads and all(load and load[capability] for load in loads):
            return
        time.sleep(0.2)
    pytest.fail(f"the gateway never read the plugin's {capability} gauge from every endpoint")


async def _chat_answer(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> dict[str, Any]:
    """A chat answer, streamed (the deltas joined, with the usage chunk) or whole: its
    token ids, content, calls (name, arguments, every id seen), finish, usage and
    the gateway's decision (None from an instance)."""
    calls: dict[int, dict[str, Any]] = {}
    if not body.get("stream"):
        answer = await client.post(f"{url}/v1/chat/completions", json=body)
        assert answer.status_code == 200, answer.text
        whole = answer.json()
        choice = whole["choices"][0]
        for index, call in enumerate(choice["message"].get("tool_calls") or []):
            calls[index] = {"name": call["function"]["name"], "ids": [call["id"]],
                            "arguments": call["function"]["arguments"]}  # fmt: skip
        message = choice["message"]
        return {"ids": list(choice["token_ids"]), "text": message.get("content") or "",
                "calls": list(calls.values()), "finish": choice["finish_reason"],
                "usage": whole["usage"],
                "decision": answer.headers.get("x-pd-decision")}  # fmt: skip
    streamed = body | {"stream_options": {"include_usage": True}}
    parts: dict[str, Any] = {"ids": [], "text": "", "finish": None, "usage": None}
    async with client.stream("POST", f"{url}/v1/chat/completions", json=streamed) as response:
        assert response.status_code == 200
        parts["decision"] = response.headers.get("x-pd-decision")
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            parts["usage"] = chunk.get("usage") or parts["usage"]
            for choice in chunk["choices"]:
                parts["ids"] += choice.get("token_ids") or []
                parts["finish"] = choice.get("finish_reason") or parts["finish"]
                delta = choice.get("delta") or {}
                parts["text"] += delta.get("content") or ""
                for call in delta.get("tool_calls") or []:
                    entry = calls.setdefault(
                        call["index"], {"name": "", "arguments": "", "ids": []}
                    )
                    function = call.get("function") or {}
                    entry["ids"] += [call["id"]] if call.get("id") else []
                    entry["name"] += function.get("name") or ""
                    entry["arguments"] += function.get("arguments") or ""
    return parts | {"calls": list(calls.values())}


def _chat(url: str, body: dict[str, Any]) -> dict[str, Any]:
    async def one() -> dict[str, Any]:
        async with httpx.AsyncClient(timeout=300) as client:
            return await _chat_answer(client, url, body)

    return asyncio.run(one())


def _honours(constraint: str, answer: dict[str, Any], schema: Any = SCHEMA) -> None:
    """The answer the client got is what ``constraint`` allows, and its usage counts
    each of its tokens once."""
    assert answer["usage"]["completion_tokens"] == len(answer["ids"])
    if constraint in TOOL_CHOICES or constraint == "named-digits":
        assert answer["calls"] and answer["text"] == ""
        if constraint != "required-tool":
            assert len(answer["calls"]) == 1
        for call in answer["calls"]:
            assert len(call["ids"]) == 1, "a tool call keeps one id"
            jsonschema.validate(json.loads(call["arguments"]), schema)
        return
    assert not answer.get("calls")
    if constraint == "regex":
        assert re.fullmatch(REGEX, answer["text"]), answer["text"]
    elif constraint == "choice":
        assert answer["text"] in CONSTRAINTS["choice"]["structured_outputs"]["choice"]
    else:
        jsonschema.validate(json.loads(answer["text"]), schema)


def _cold_chat(target: Target, constraint: str, stream: bool = False) -> dict[str, Any]:
    """A chat request of a new 160-token prompt under ``constraint``, greedy."""
    text = _text_of(target.reference, target.model, 160, uuid.uuid4().hex)
    body = {"model": target.model, "messages": [{"role": "user", "content": text}],
            "max_tokens": 80, "temperature": 0, "return_token_ids": True,
            "stream": stream}  # fmt: skip
    return body | CONSTRAINTS[constraint]


def _skip_unsupported(target: Target, constraint: str) -> None:
    """Skip a tool choice the target's servers do not serve (no tool-call parser)."""
    if target.name == "sim" or constraint not in TOOL_CHOICES:
        return
    body = _cold_chat(target, constraint) | {"max_tokens": 1}
    probe = _post(target.reference, "/v1/chat/completions", body)
    if probe.status_code == 400:
        pytest.skip(f"the target's servers refuse {constraint}: {probe.text[:200]}")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("constraint", list(CONSTRAINTS))
def test_a_cold_constrained_request_goes_pd_and_a_warm_one_decode(
    target: Target, gateway: str, constraint: str, stream: bool
) -> None:
    _admission_only_known(gateway)
    _skip_unsupported(target, constraint)
    decoder, prefiller = target.decoders[0], target.prefillers[0]
    for _ in range(8):
        body = _cold_chat(target, constraint, stream)
        hits = metric(decoder, "vllm:external_prefix_cache_hits_total")
        prefilled = metric(prefiller, "vllm:prompt_tokens_total")
        cold = _chat(gateway, body)
        assert cold["decision"] == "pd"
        assert metric(prefiller, "vllm:prompt_tokens_total") > prefilled
        # an answer whose first token ends it is the prefiller's whole answer: no decode
        # leg, no KV moved (a choice of one token can end there); a document cut at
        # max_tokens cannot be validated (the tiny model's greedy required-tool call may
        # run on in whitespace the grammar allows): another prompt is drawn for either
        if len(cold["ids"]) > 1 and cold["finish"] != "length":
            break
    else:
        pytest.fail("eight cold prompts in a row ended at their first token or at max_tokens")
    assert metric(decoder, "vllm:external_prefix_cache_hits_total") > hits
    _honours(constraint, cold)
    reference = _chat(target.reference, body | {"cache_hit_threshold": 0, "stream": False})
    assert cold["ids"] == reference["ids"]
    # vLLM dumps a whole answer's required calls again (", " and ": "), streams them raw
    assert [json.loads(c["arguments"]) for c in cold["calls"]] == [
        json.loads(c["arguments"]) for c in reference["calls"]
    ]
    warm = _chat(gateway, body)
    assert warm["decision"] == "decode"
    assert warm["ids"] == cold["ids"] and warm["text"] == cold["text"]
    _honours(constraint, warm)
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


@pytest.mark.parametrize("extra", [{"prompt_logprobs": 1}], ids=["prompt-logprobs"])
def test_a_preempted_constrained_request_is_recomputed_by_its_decoder(
    target: Target, gateway: str, extra: dict[str, Any]
) -> None:
    if not target.preemption:
        pytest.skip("this target's decoder cannot be forced to preempt (PDO_E2E_PREEMPTION=1)")
    _admission_only_known(gateway)
    decoder = target.decoders[0]
    handbacks = metric(gateway, "pd_orchestrator_handbacks_total")
    rejected = metric(decoder, "vllm:cache_threshold_rejections_total", phase="preemption")
    for _ in range(PREEMPTION_ROUNDS):
        if asyncio.run(_preempted_round(target, gateway, extra)):
            break
    else:
        pytest.fail(f"the decoder preempted nothing in {PREEMPTION_ROUNDS} rounds")
    assert metric(gateway, "pd_orchestrator_handbacks_total") == handbacks
    after = metric(decoder, "vllm:cache_threshold_rejections_total", phase="preemption")
    assert after == rejected


DIGITS = 80
"""Items of the array the resumed schema asks for: about 160-240 tokens (digits and
", " separators), enough for three of them to overflow the CPU decoder's KV cache
and within its 512-token context with the 161-token prompt (``MAX_TOKENS``)."""
MAX_TOKENS = 340
ARRAY_SCHEMA = {
    "type": "array",
    "items": {"type": "integer", "minimum": 0, "maximum": 9},
    "minItems": DIGITS,
    "maxItems": DIGITS,
}
RESUMED: dict[str, dict[str, Any]] = {
    "json-schema": {"response_format": {"type": "json_schema",
                                        "json_schema": {"name": "digits", "schema": ARRAY_SCHEMA}}},
    "structured-json": {"structured_outputs": {"json": ARRAY_SCHEMA}},
    "logprobs": {"logprobs": 2},
}  # fmt: skip


Reader = Callable[[httpx.AsyncClient, str, dict[str, Any]], Awaitable[dict[str, Any]]]


async def _warm_then_together(
    target: Target, gateway: str, path: str, bodies: list[dict[str, Any]], read: Reader
) -> tuple[bool, list[dict[str, Any]], list[dict[str, Any]]]:
    """Each body once with one token (cold: P/D, so the decoder holds its prompt), then
    all together through the gateway; whether the gateway handed one back (its
    continuation prefilled on the prefiller), what ``read`` made of each answer, and
    of the reference's (whole, threshold 0)."""
    prefiller = target.prefillers[0]
    async with httpx.AsyncClient(timeout=600) as client:
        for body in bodies:
            once = body | {"max_tokens": 1, "stream": False}
            warm = await client.post(f"{gateway}{path}", json=once)
            assert warm.status_code == 200, warm.text
        handbacks = metric(gateway, "pd_orchestrator_handbacks_total")
        prefilled = metric(prefiller, "vllm:prompt_tokens_total")
        results = await asyncio.gather(*(read(client, gateway, b) for b in bodies))
        handed_back = metric(gateway, "pd_orchestrator_handbacks_total") > handbacks
        if handed_back:  # the continuation went through the prefiller
            assert metric(prefiller, "vllm:prompt_tokens_total") > prefilled
        plain = {"stream": False, "cache_hit_threshold": 0}
        references = [await read(client, target.reference, b | plain) for b in bodies]
    return handed_back, list(results), references


async def _handed_back_round(target: Target, gateway: str, extra: dict[str, Any]) -> bool:
    """Token prompts that overflow the decoder's KV, warmed (P/D once), then together,
    streamed and whole: True when the gateway handed one back. Every answer is the
    reference's: its tokens, its logprob tokens and text offsets (one offset sequence
    across legs), its usage counts each token once, and a structured one is one
    document valid against the schema."""
    count, prompt_tokens, output = _preemption_shape(target)
    rng = random.Random(uuid.uuid4().hex)
    prompts = [[rng.randrange(1000, 3000) for _ in range(prompt_tokens)] for _ in range(count)]
    # the simulator's free text ends by chance: run it to the shape's length
    free = "logprobs" in extra and target.name == "sim"
    length = {"max_tokens": output, "ignore_eos": True} if free else {}
    bodies = [{"model": target.model, "prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0,
               "return_token_ids": True, "stream": i % 2 == 0, "cache_hit_threshold": 0.9}
              | length | extra for i, p in enumerate(prompts)]  # fmt: skip
    handed_back, results, references = await _warm_then_together(
        target, gateway, "/v1/completions", bodies, _completion_with_usage
    )
    for result, reference in zip(results, references, strict=True):
        assert result["ids"] == reference["ids"], "the output differs from the reference"
        assert result["usage"]["completion_tokens"] == len(result["ids"])
        if "logprobs" in extra:
            assert len(result["tokens"]) == len(result["ids"])
            for name in LOGPROB_LISTS:
                assert result[name] == reference[name], f"logprobs {name} differ"
        if "logprobs" not in extra:
            jsonschema.validate(json.loads(result["text"]), ARRAY_SCHEMA)
    return handed_back


async def _completion_with_usage(
    client: httpx.AsyncClient, url: str, body: dict[str, Any]
) -> dict[str, Any]:
    """:func:`_completion_answer`, a stream asked for its usage chunk."""
    usage = {"stream_options": {"include_usage": True}} if body.get("stream") else {}
    return await _completion_answer(client, url, body | usage)


@pytest.mark.parametrize("constraint", list(RESUMED))
def test_a_preempted_structured_output_or_logprobs_request_is_handed_back_and_continued(
    target: Target, gateway: str, constraint: str
) -> None:
    """A structured output resumes with its grammar advanced (counted ``resumable``); a
    logprobs request needs no plugin support: its continuation asks for them."""
    if not target.preemption:
        pytest.skip("this target's decoder cannot be forced to preempt (PDO_E2E_PREEMPTION=1)")
    _admission_only_known(gateway, "resumes")
    decoder = target.decoders[0]
    rejected = metric(decoder, "vllm:cache_threshold_rejections_total", phase="preemption")
    resumable = metric(gateway, "pd_orchestrator_constrained_requests_total", threshold="resumable")
    for _ in range(PREEMPTION_ROUNDS):
        if asyncio.run(_handed_back_round(target, gateway, RESUMED[constraint])):
            break
    else:
        pytest.fail(f"the gateway handed nothing back in {PREEMPTION_ROUNDS} rounds")
    after = metric(decoder, "vllm:cache_threshold_rejections_total", phase="preemption")
    assert after > rejected
    now = metric(gateway, "pd_orchestrator_constrained_requests_total", threshold="resumable")
    assert now > resumable if constraint != "logprobs" else now == resumable


DIGITS_TOOL = {
    "type": "function",
    "function": {
        "name": "digits",
        "description": "Record digits.",
        "parameters": {"type": "object", "properties": {"digits": ARRAY_SCHEMA},
                       "required": ["digits"], "additionalProperties": False},
    },
}  # fmt: skip
NAMED_DIGITS = {"tools": [DIGITS_TOOL],
                "tool_choice": {"type": "function", "function": {"name": "digits"}}}  # fmt: skip
CHAT_PROMPT_TOKENS = 161
"""Chat prompt tokens, about: within the decoder's context with ``MAX_TOKENS`` of
output. A named call's JSON has no spaces (about 170 tokens) and the prompts share
the template's rendering of the tools, so one request more than the completions
rounds overflows the decoder's KV cache as much."""


def _chat_tokens(target: Target, text: str) -> int:
    """Tokens of the chat prompt of ``text`` with the tools (the template renders them)."""
    body = {"model": target.model, "messages": [{"role": "user", "content": text}],
            "tools": NAMED_DIGITS["tools"]}  # fmt: skip
    return int(httpx.post(f"{target.reference}/tokenize", json=body, timeout=30).json()["count"])


def _chat_text_of(target: Target, tokens: int, seed: str) -> str:
    """A user message whose chat prompt (template and tools included) has ``tokens``
    tokens or a few more, one past a whole number of 32-token blocks: warm, all but
    that token hit, so a threshold of 0.9 admits it."""
    overhead = _chat_tokens(target, "")
    text = _text_of(target.reference, target.model, max(8, tokens - overhead - 8), seed)
    for step in range(96):
        if _chat_tokens(target, text) % 32 == 1:
            return text
        text += " a" if step % 2 else "."  # one token or two, whatever the tokenizer
    pytest.fail("no chat prompt length one past a block boundary")


async def _named_tool_round(target: Target, gateway: str) -> bool:
    """Chat requests that must call ``digits``, overflowing the decoder's KV together:
    True when the gateway handed one back. Every answer is the reference's tokens and
    arguments: one call with one id, its arguments valid for the tool, each token
    counted once."""
    count, _, _ = _preemption_shape(target)
    texts = [_chat_text_of(target, CHAT_PROMPT_TOKENS, uuid.uuid4().hex) for _ in range(count + 1)]
    bodies = [{"model": target.model, "messages": [{"role": "user", "content": text}],
               "max_tokens": MAX_TOKENS, "temperature": 0, "return_token_ids": True,
               "stream": i % 2 == 0, "cache_hit_threshold": 0.9} | NAMED_DIGITS
              for i, text in enumerate(texts)]  # fmt: skip
    handed_back, results, references = await _warm_then_together(
        target, gateway, "/v1/chat/completions", bodies, _chat_answer
    )
    parameters = DIGITS_TOOL["function"]["parameters"]  # type: ignore[index]
    for result, reference in zip(results, references, strict=True):
        assert result["ids"] == reference["ids"], "the output differs from the reference"
        assert [c["arguments"] for c in result["calls"]] == [
            c["arguments"] for c in reference["calls"]
        ]
        assert result["text"] == reference["text"]
        _honours("named-digits", result, parameters)
    return handed_back


def test_a_preempted_named_tool_call_is_handed_back_and_continued_as_the_same_call(
    target: Target, gateway: str
) -> None:
    if not target.preemption:
        pytest.skip("this target's decoder cannot be forced to preempt (PDO_E2E_PREEMPTION=1)")
    if target.name == "live":
        probe = _post(target.reference, "/v1/chat/completions",
                      {"model": target.model, "messages": [{"role": "user", "content": "x"}],
                       "max_tokens": 1} | NAMED_DIGITS)  # fmt: skip
        if probe.status_code == 400 and "tool-call-parser" in probe.text:
            pytest.skip("the target's servers run no tool-call parser (--tool-call-parser)")
    _admission_only_known(gateway, "resumes")
    resumable = metric(gateway, "pd_orchestrator_constrained_requests_total", threshold="resumable")
    for _ in range(PREEMPTION_ROUNDS):
        if asyncio.run(_named_tool_round(target, gateway)):
            break
    else:
        pytest.fail(f"the gateway handed nothing back in {PREEMPTION_ROUNDS} rounds")
    now = metric(gateway, "pd_orchestrator_constrained_requests_total", threshold="resumable")
    assert now > resumable
