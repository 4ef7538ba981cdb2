"""The simulator's constrained answers over HTTP: structured outputs and tool calls in
vLLM's shapes, whole and streamed, a continuation that resumes the document, and
logprobs consistent with the tokens."""

from __future__ import annotations

import json
from typing import Any

import httpx
import jsonschema
import pytest

from pd_orchestrator.children import Child

from ..conftest import SimFactory

pytestmark = pytest.mark.anyio
MODEL = "sim-model"
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1,
                                                         "maximum": 7}},
    "required": ["city", "days"],
    "additionalProperties": False,
}  # fmt: skip
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "string", "enum": ["utc", "cet"]}},
        "required": ["zone"]}}},
]  # fmt: skip
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
NAMED = {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}


@pytest.fixture(scope="module")
def sim(module_sims: SimFactory) -> Child:
    return module_sims("--profile", "instant", "--block-size", "16")


def _chat(text: str, **fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}],
            "max_tokens": 200, "return_token_ids": True} | fields  # fmt: skip


async def _post(url: str, path: str, body: Any) -> httpx.Response:
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        return await client.post(path, json=body)


async def _chunks(url: str, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    async with (
        httpx.AsyncClient(base_url=url, timeout=10) as client,
        client.stream("POST", path, json=body | {"stream": True}) as response,
    ):
        assert response.status_code == 200
        text = (await response.aread()).decode()
    events = [e[len("data: ") :] for e in text.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def _streamed_calls(chunks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The calls a stream's deltas make: name, joined arguments and every id seen."""
    calls: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            for call in choice["delta"].get("tool_calls") or []:
                entry = calls.setdefault(call["index"], {"name": None, "arguments": "", "ids": []})
                entry["ids"] += [call["id"]] if call.get("id") else []
                function = call["function"]
                entry["name"] = function.get("name") or entry["name"]
                entry["arguments"] += function.get("arguments") or ""
    return [calls[i] for i in sorted(calls)]


async def test_a_named_tool_is_called_with_valid_arguments_whole_and_streamed(sim: Child) -> None:
    body = _chat("What is the weather in Paris?", **NAMED)
    whole = (await _post(sim.url, "/v1/chat/completions", body)).json()
    choice = whole["choices"][0]
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "get_weather"
    assert call["id"].startswith("chatcmpl-tool-") and choice["message"]["content"] == ""
    jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER)
    assert choice["finish_reason"] == "stop"  # vLLM's for a named tool choice
    assert whole["usage"]["completion_tokens"] == len(choice["token_ids"])
    chunks = await _chunks(sim.url, "/v1/chat/completions", body)
    (streamed,) = _streamed_calls(chunks)
    assert streamed["arguments"] == call["function"]["arguments"]
    assert streamed["name"] == "get_weather" and len(streamed["ids"]) == 1
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "stop"


async def test_required_calls_tools_and_finishes_with_tool_calls(sim: Child) -> None:
    for index in range(6):
        body = _chat(f"Weather or time, take {index}.", tools=TOOLS, tool_choice="required")
        whole = (await _post(sim.url, "/v1/chat/completions", body)).json()
        choice = whole["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        calls = choice["message"]["tool_calls"]
        assert calls and len({c["id"] for c in calls}) == len(calls)
        for call in calls:
            name = call["function"]["name"]
            jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[name])
        streamed = _streamed_calls(await _chunks(sim.url, "/v1/chat/completions", body))
        assert [(c["name"], json.loads(c["arguments"])) for c in streamed] == [
            (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls
        ]
        if any(json.loads(c["function"]["arguments"]) for c in calls):  # vLLM's dumps
            assert any(": " in c["function"]["arguments"] for c in calls)
        assert all(len(c["ids"]) == 1 for c in streamed)


async def test_auto_chooses_between_a_call_and_text_by_the_seed(sim: Child) -> None:
    answers = set()
    for index in range(16):
        body = _chat(f"Maybe call a tool, take {index}.", tools=TOOLS)
        choice = (await _post(sim.url, "/v1/chat/completions", body)).json()["choices"][0]
        called = bool(choice["message"]["tool_calls"])
        assert choice["finish_reason"] in (("tool_calls",) if called else ("stop", "length"))
        answers.add(called)
        again = (await _post(sim.url, "/v1/chat/completions", body)).json()["choices"][0]
        assert again["token_ids"] == choice["token_ids"]  # deterministic
    assert answers == {True, False}


@pytest.mark.parametrize(
    "constraint",
    [{"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}}},
     {"structured_outputs": {"json": WEATHER}},
     {"structured_outputs": {"json": json.dumps(WEATHER)}}],
    ids=["response-format", "structured-outputs", "schema-as-string"],
)  # fmt: skip
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
async def test_a_json_schema_answer_validates_on_both_apis(
    sim: Child, constraint: dict[str, Any], path: str
) -> None:
    if path == "/v1/chat/completions":
        body = _chat("The weather, as JSON.") | constraint
    else:
        body = {"model": MODEL, "prompt": "The weather:", "max_tokens": 200} | constraint
    answer = (await _post(sim.url, path, body)).json()
    choice = answer["choices"][0]
    text = choice["text"] if "text" in choice else choice["message"]["content"]
    jsonschema.validate(json.loads(text), WEATHER)
    assert choice["finish_reason"] == "stop"
    chunks = await _chunks(sim.url, path, body)
    streamed = "".join(
        c["choices"][0].get("text") or (c["choices"][0].get("delta") or {}).get("content") or ""
        for c in chunks
        if c["choices"]
    )
    assert streamed == text


async def test_regex_choice_and_json_object(sim: Child) -> None:
    cases = [({"regex": r"[A-Z]{2}-\d{4}"}, lambda t: len(t) == 7 and t[2] == "-"),
             ({"choice": ["alpha", "beta"]}, lambda t: t in ("alpha", "beta")),
             ({"json_object": True}, lambda t: isinstance(json.loads(t), dict))]  # fmt: skip
    for outputs, check in cases:
        body = {"model": MODEL, "prompt": "Answer:", "max_tokens": 60}
        body["structured_outputs"] = outputs
        text = (await _post(sim.url, "/v1/completions", body)).json()["choices"][0]["text"]
        assert check(text), (outputs, text)
    body = _chat("JSON please") | {"response_format": {"type": "json_object"}}
    message = (await _post(sim.url, "/v1/chat/completions", body)).json()["choices"][0]["message"]
    assert isinstance(json.loads(message["content"]), dict)


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [({"structured_outputs": {"grammar": "root ::= 'a'"}}, "structured_outputs", "grammar"),
     ({"structured_outputs": {"json": {"not": {}}}}, "structured_outputs", "'not'"),
     ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
      "response_format", "schema"),
     ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
      "tool_choice", "nope"),
     ({"tool_choice": "required"}, "tool_choice", "tools")],
)  # fmt: skip
async def test_unsupported_or_malformed_constraints_get_a_400_naming_them(
    sim: Child, fields: dict[str, Any], param: str, words: str
) -> None:
    answer = await _post(sim.url, "/v1/chat/completions", _chat("x") | fields)
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["param"] == param and words in error["message"]


async def test_a_continuation_resumes_the_named_call_as_the_gateway_sends_it(sim: Child) -> None:
    """Prompt + the first k tokens on /v1/completions with the tool's parameters as
    ``structured_outputs.json`` and ``cache_hit_resume_tokens`` k: the rest of the call."""
    body = _chat("Weather in Oslo?", **NAMED)
    whole = (await _post(sim.url, "/v1/chat/completions", body)).json()
    prompt, generated = whole["prompt_token_ids"], whole["choices"][0]["token_ids"]
    arguments = whole["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]
    for k in (1, len(generated) // 2, len(generated) - 2):
        rest = {"model": MODEL, "prompt": prompt + generated[:k], "max_tokens": 200,
                "return_token_ids": True, "structured_outputs": {"json": WEATHER},
                "cache_hit_resume_tokens": k}  # fmt: skip
        answer = (await _post(sim.url, "/v1/completions", rest)).json()
        assert generated[:k] + answer["choices"][0]["token_ids"] == generated
        assert answer["usage"]["completion_tokens"] == len(generated) - k
    assert json.loads(arguments)  # the uninterrupted call parses
    wrong = {"model": MODEL, "prompt": [*prompt, 91, 49], "structured_outputs": {"json": WEATHER},
             "cache_hit_resume_tokens": 2}  # fmt: skip
    refused = await _post(sim.url, "/v1/completions", wrong)
    assert refused.status_code == 400 and "cache_hit_resume_tokens" in refused.text


async def test_logprobs_follow_the_tokens_whole_streamed_and_continued(sim: Child) -> None:
    body = {"model": MODEL, "prompt": "Logprobs, please.", "max_tokens": 12, "logprobs": 3,
            "ignore_eos": True, "return_token_ids": True}  # fmt: skip
    whole = (await _post(sim.url, "/v1/completions", body)).json()["choices"][0]
    logprobs, ids = whole["logprobs"], whole["token_ids"]
    assert "".join(logprobs["tokens"]) == whole["text"] and len(logprobs["tokens"]) == len(ids)
    for token, value, top in zip(
        logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"], strict=True
    ):
        assert next(iter(top)) == token and top[token] == value == max(top.values()) <= 0
        assert len(top) == 3
    offsets = logprobs["text_offset"]
    assert offsets[0] == 0 and all(
        b - a == len(t) for a, b, t in zip(offsets, offsets[1:], logprobs["tokens"], strict=False)
    )
    chunks = await _chunks(sim.url, "/v1/completions", body)
    streamed: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "text_offset": []}
    for chunk in chunks:
        for name in streamed:
            streamed[name] += (chunk["choices"][0]["logprobs"] or {}).get(name) or []
    assert streamed == {name: logprobs[name] for name in streamed}
    prompt = (await _post(sim.url, "/tokenize", {"prompt": "Logprobs, please."})).json()["tokens"]
    rest = body | {"prompt": prompt + ids[:5], "max_tokens": 7}
    continued = (await _post(sim.url, "/v1/completions", rest)).json()["choices"][0]["logprobs"]
    assert continued["token_logprobs"] == logprobs["token_logprobs"][5:]
    chat = _chat("Logprobs, please.", logprobs=True, top_logprobs=2, max_tokens=6)
    content = (await _post(sim.url, "/v1/chat/completions", chat)).json()["choices"][0]
    entries = content["logprobs"]["content"]
    assert "".join(e["token"] for e in entries) == content["message"]["content"]
    assert all(len(e["top_logprobs"]) == 2 and e["top_logprobs"][0]["token"] == e["token"]
               for e in entries)  # fmt: skip
