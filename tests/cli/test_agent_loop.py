"""An agent against the embedded default (``make run``: ``up --config configs/local.yaml``):
the openai SDK runs a two-step tool-using loop, whole and streamed, and parses every
answer (a named tool's arguments, then the model's reply to the tool's result)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from openai import OpenAI

from pd_orchestrator.children import Child, python_command, start_child, stop_child

ROOT = Path(__file__).resolve().parents[2]
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": WEATHER,
        },
    }
]


@pytest.fixture(scope="module")
def local(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Child]:
    """``up`` with the demo's config, on free loopback ports."""
    tmpdir = tmp_path_factory.mktemp("up")
    child = start_child(
        "up",
        python_command("up", "--config", str(ROOT / "configs" / "local.yaml"), "--port", "0"),
        env={**os.environ, "TMPDIR": str(tmpdir)},
        timeout=90,
    )
    try:
        yield child
    finally:
        stop_child(child)


def _client(url: str) -> OpenAI:
    return OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=60, max_retries=0)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_an_openai_client_runs_a_two_step_tool_loop(local: Child, stream: bool) -> None:
    client = _client(local.url)
    model = client.models.list().data[0].id
    messages: list[Any] = [{"role": "user", "content": f"Weather in Lyon? ({stream})"}]
    forced: Any = {"type": "function", "function": {"name": "get_weather"}}
    if stream:
        calls: dict[int, dict[str, str]] = {}
        with client.chat.completions.stream(
            model=model, messages=messages, tools=TOOLS, tool_choice=forced, max_tokens=200
        ) as events:
            for event in events:
                if event.type == "tool_calls.function.arguments.done":
                    calls[event.index] = {"name": event.name, "arguments": event.arguments}
            final = events.get_final_completion()
        message = final.choices[0].message
        assert [c["arguments"] for c in calls.values()] == [
            c.function.arguments for c in message.tool_calls or []
        ]
    else:
        first = client.chat.completions.create(
            model=model, messages=messages, tools=TOOLS, tool_choice=forced, max_tokens=200
        )
        message = first.choices[0].message
    (call,) = message.tool_calls or []
    assert call.type == "function" and call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)  # the step an agent takes: no parse error
    jsonschema.validate(arguments, WEATHER)
    function = {"name": "get_weather", "arguments": call.function.arguments}
    messages += [
        {"role": "assistant", "content": message.content or "",
         "tool_calls": [{"id": call.id, "type": "function", "function": function}]},
        {"role": "tool", "tool_call_id": call.id,
         "content": json.dumps({"city": arguments["city"], "temperature": 21})},
    ]  # fmt: skip
    second = client.chat.completions.create(
        model=model, messages=messages, tools=TOOLS, tool_choice="auto", max_tokens=200
    )
    choice = second.choices[0]
    if choice.message.tool_calls:  # the model may call again: its arguments parse too
        assert choice.finish_reason == "tool_calls"
        for again in choice.message.tool_calls:
            jsonschema.validate(json.loads(again.function.arguments), WEATHER)
    else:
        assert choice.message.content and choice.finish_reason in ("stop", "length")
    assert second.usage is not None and second.usage.completion_tokens > 0
