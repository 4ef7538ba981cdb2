"""Tokenize once, the pure parts: the ``/tokenize`` body, which requests may go as token
ids, the leg bodies of a token route, and a chat client's id when the first answer is a
completions one."""

from __future__ import annotations

from typing import Any

import pytest

from pd_orchestrator.flows.bodies import COMPLETIONS, Route
from pd_orchestrator.flows.transcript import Transcript
from pd_orchestrator.openai.tokenize import token_ids, tokenize_body

from .test_flow import _request

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 5}


def test_the_tokenize_body_carries_what_changes_the_ids() -> None:
    chat = CHAT | {"chat_template_kwargs": {"enable_thinking": False}, "temperature": 0.3,
                   "add_generation_prompt": False, "continue_final_message": True}  # fmt: skip
    assert tokenize_body(chat, chat=True) == {
        "model": "m",
        "messages": CHAT["messages"],
        "chat_template_kwargs": {"enable_thinking": False},
        "add_generation_prompt": False,
        "continue_final_message": True,
    }
    completion = {"model": "m", "prompt": "hello", "add_special_tokens": False, "n": 2}
    assert tokenize_body(completion, chat=False) == {
        "model": "m", "prompt": "hello", "add_special_tokens": False,
    }  # fmt: skip
    assert tokenize_body({"model": "m", "prompt": [1, 2]}, chat=False) is None
    assert tokenize_body({"model": "m", "messages": "x"}, chat=True) is None


@pytest.mark.parametrize(
    ("answer", "ids"),
    [
        ({"tokens": [1, 2, 3]}, [1, 2, 3]),
        ({"tokens": []}, None),
        ({"tokens": [1, -2]}, None),
        ({"tokens": [1, True]}, None),
        ({"tokens": "1 2"}, None),
        ({}, None),
        (None, None),
    ],
)
def test_only_a_list_of_token_ids_is_taken(answer: Any, ids: list[int] | None) -> None:
    assert token_ids(answer) == ids


@pytest.mark.parametrize(
    ("kind", "body", "tokenizable"),
    [
        ("completion", {"prompt": "hello"}, True),
        ("completion", {"prompt": [1, 2]}, False),  # already ids
        ("completion", {"prompt": "hello", "echo": True}, False),
        ("completion", {"prompt": "hello", "echo": False}, True),
        ("completion", {"prompt": "hello", "suffix": "!"}, False),
        ("completion", {"prompt": "hello", "logprobs": 2}, False),
        ("completion", {"prompt": "hello", "truncate_prompt_tokens": 3}, False),
        ("chat", {"messages": CHAT["messages"]}, True),
        ("chat", {"messages": CHAT["messages"], "tools": [{"type": "function"}]}, False),
        ("chat", {"messages": CHAT["messages"], "reasoning_effort": "low"}, False),
        ("chat", {"messages": CHAT["messages"], "response_format": {"type": "text"}}, True),
        (
            "chat",
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            False,
        ),
        (
            "chat",
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]},
            True,
        ),
    ],
)
def test_which_requests_may_go_as_token_ids(
    kind: str, body: dict[str, Any], tokenizable: bool
) -> None:
    assert _request(kind, {"model": "m", **body}).tokenizable is tokenizable


def test_a_token_route_sends_the_ids_on_completions_without_chat_fields() -> None:
    request = _request("chat", CHAT | {"stream": True, "temperature": 0.0})
    assert Route.of(request) == Route("/v1/chat/completions", "chat")
    route = Route.of(request, [7, 8, 9])
    assert (route.path, route.kind) == (COMPLETIONS, "completion")
    body = route.body(request, 0.4, stream=True, admission_only=False)
    assert body["prompt"] == [7, 8, 9] and "messages" not in body
    assert "max_completion_tokens" not in body and body["max_tokens"] == 5
    assert body["cache_hit_threshold"] == 0.4 and body["return_token_ids"] is True
    assert body["temperature"] == 0.0 and body["stream_options"] == {"include_usage": True}
    text = Route.of(request).body(request, 0.4, stream=False, admission_only=True)
    assert text["messages"] == CHAT["messages"] and text["stream"] is False
    assert text["cache_hit_admission_only"] is True
    assert "cache_hit_admission_only" not in Route.of(request).body(
        request, 0.4, stream=False, admission_only=False
    )


def test_a_chat_client_keeps_the_chat_id_prefix() -> None:
    chat = Transcript(_request("chat", CHAT))
    assert chat.adopt_identity({"id": "cmpl-abc", "created": 3}).response_id == "chatcmpl-abc"
    completion = Transcript(_request("completion", {"model": "m", "prompt": "x"}))
    assert completion.adopt_identity({"id": "cmpl-abc"}).response_id == "cmpl-abc"
