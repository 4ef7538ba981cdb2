"""Logprobs across legs, in the client's shape: the conversions against hand-made cases
shaped as vLLM 0.32/0.33 answer them."""

from __future__ import annotations

from typing import Any

import pytest

from pd_orchestrator.flows.logprobs import (
    LogprobsRecord,
    chat_content,
    continuation_logprobs,
    for_client,
    next_offset,
    shifted,
)

COMPLETIONS = {
    "tokens": [" the", "é"],
    "token_logprobs": [-0.25, -1.5],
    "top_logprobs": [{" the": -0.25, " a": -2.0, " an": -3.0}, {"é": -1.5, "e": -0.5}],
    "text_offset": [0, 4],
}


@pytest.mark.parametrize(
    ("kind", "body", "expected"),
    [
        ("completion", {"logprobs": 3}, 3),
        ("completion", {"logprobs": 0}, 0),
        ("completion", {}, None),
        ("completion", {"logprobs": True}, None),
        ("chat", {"logprobs": True, "top_logprobs": 2}, 2),
        ("chat", {"logprobs": True}, 0),
        ("chat", {"logprobs": False, "top_logprobs": 2}, None),
        ("chat", {}, None),
    ],
)
def test_a_continuation_asks_logprobs_as_completions_does(
    kind: Any, body: dict[str, Any], expected: int | None
) -> None:
    assert continuation_logprobs(body, kind) == expected


def test_completions_logprobs_become_chat_content_entries() -> None:
    """The first ``top`` entries of each step's dict (vLLM's chat takes i < k of the
    same dict), bytes the UTF-8 of each token."""
    content = chat_content(COMPLETIONS, 2)
    assert content == [
        {"token": " the", "logprob": -0.25, "bytes": [32, 116, 104, 101],
         "top_logprobs": [{"token": " the", "logprob": -0.25, "bytes": [32, 116, 104, 101]},
                          {"token": " a", "logprob": -2.0, "bytes": [32, 97]}]},
        {"token": "é", "logprob": -1.5, "bytes": [195, 169],
         "top_logprobs": [{"token": "é", "logprob": -1.5, "bytes": [195, 169]},
                          {"token": "e", "logprob": -0.5, "bytes": [101]}]},
    ]  # fmt: skip
    assert [e["top_logprobs"] for e in chat_content(COMPLETIONS, 0) or []] == [[], []]


@pytest.mark.parametrize("bad", [None, [], {"tokens": "x"}, {"token_logprobs": []}])
def test_what_is_not_completions_logprobs_converts_to_none(bad: Any) -> None:
    assert chat_content(bad, 1) is None
    assert for_client(bad, "completion", "chat", 1, 0) is None


def test_offsets_move_past_what_the_client_got_without_changing_the_input() -> None:
    moved = shifted(COMPLETIONS, 10)
    assert moved["text_offset"] == [10, 14] and COMPLETIONS["text_offset"] == [0, 4]
    assert shifted(COMPLETIONS, 0) is COMPLETIONS
    assert next_offset(moved, 0) == 14 + len("é")
    assert next_offset({"tokens": []}, 7) == 7


def test_for_client_keeps_a_same_api_chat_leg_and_shapes_the_rest() -> None:
    chat = {"content": [{"token": "x", "logprob": -1.0}]}
    assert for_client(chat, "chat", "chat", 1, 5) is chat
    assert for_client(COMPLETIONS, "completion", "chat", 1, 5) == {
        "content": chat_content(COMPLETIONS, 1)
    }
    assert for_client(COMPLETIONS, "completion", "completion", 1, 5)["text_offset"] == [5, 9]


def test_a_whole_answer_merges_every_leg_in_the_client_shape() -> None:
    completion = LogprobsRecord("completion")
    completion.add(COMPLETIONS)
    completion.add(shifted(COMPLETIONS, next_offset(COMPLETIONS, 0)))
    merged = completion.as_dict()
    assert merged["tokens"] == [" the", "é", " the", "é"]
    assert merged["text_offset"] == [0, 4, 5, 9]
    chat = LogprobsRecord("chat")
    chat.add({"content": [{"token": "a"}]})
    chat.add(None)
    chat.add({"content": [{"token": "b"}]})
    assert chat.as_dict() == {"content": [{"token": "a"}, {"token": "b"}]}
