"""Pure pieces of the flows: bodies, chunk reading and writing, the transcript."""

from __future__ import annotations

from typing import Any

import pytest

from pd_orchestrator.flows.bodies import continuation_body, leg_body
from pd_orchestrator.flows.chunks import (
    ChunkView,
    Identity,
    MalformedChunk,
    relay_chunk,
    render_chunk,
    view_answer,
    view_chunk,
)
from pd_orchestrator.flows.request import ClientRequest
from pd_orchestrator.flows.transcript import Transcript
from pd_orchestrator.openai.protocol import ChatCompletionRequest, CompletionRequest, parse_request


def _request(body: dict[str, Any], kind: str = "completion") -> ClientRequest:
    if kind == "completion":
        view: Any = parse_request(CompletionRequest, body)
        path = "/v1/completions"
    else:
        view = parse_request(ChatCompletionRequest, body)
        path = "/v1/chat/completions"
    return ClientRequest(kind, path, body, view, "rid", 0.0)  # type: ignore[arg-type]


CHAT = {
    "model": "m",
    "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
    "max_completion_tokens": 50,
    "min_tokens": 20,
    "stream": True,
    "tools": [{"type": "function", "function": {"name": "f"}}],
    "temperature": 0.0,
    "logprobs": True,
}


def test_leg_body_adds_threshold_token_ids_and_usage_for_streams() -> None:
    body = leg_body(_request(CHAT, "chat"), 0.6)
    assert body["cache_hit_threshold"] == 0.6 and body["return_token_ids"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert "cache_hit_threshold" not in CHAT


def test_continuation_of_a_chat_request_is_a_token_prompt() -> None:
    body = continuation_body(_request(CHAT, "chat"), [1, 2, 3, 9, 9], 30, 0.0)
    assert body["prompt"] == [1, 2, 3, 9, 9]
    assert body["max_tokens"] == 20 and body["min_tokens"] == 0
    for dropped in ("messages", "tools", "top_logprobs", "max_completion_tokens"):
        assert dropped not in body
    assert body["temperature"] == 0.0 and body["cache_hit_threshold"] == 0.0
    assert body["logprobs"] == 0  # chat's logprobs: true asks completions for no alternatives


def test_continuation_without_a_limit_has_none() -> None:
    request = _request({"model": "m", "messages": [{"role": "user", "content": "x"}]}, "chat")
    assert "max_tokens" not in continuation_body(request, [1], 5, 0.0)


def test_chat_chunk_views() -> None:
    role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
    content = {"choices": [{"index": 0, "delta": {"content": " hi"}, "token_ids": [7]}]}
    rejected = {"choices": [{"index": 0, "delta": {}, "finish_reason": "cache_threshold"}]}
    usage = {"choices": [], "usage": {"completion_tokens": 3}}
    assert not view_chunk(role, "chat").decisive
    assert view_chunk(content, "chat").decisive and view_chunk(content, "chat").token_ids == (7,)
    assert view_chunk(rejected, "chat").rejected and view_chunk(rejected, "chat").decisive
    assert not view_chunk(usage, "chat").has_choice
    assert view_chunk(usage, "chat").completion_tokens == 3


@pytest.mark.parametrize(
    ("kind", "chunk"),
    [
        ("completion", {"choices": {"index": 0, "text": "x"}}),
        ("completion", {"choices": ["x"]}),
        ("completion", {"choices": [{"index": 0, "text": "x", "token_ids": ["7"]}]}),
        ("completion", {"choices": [{"index": 0, "text": "x", "token_ids": [True]}]}),
        ("completion", {"choices": [{"index": 0, "text": "x", "token_ids": 7}]}),
        ("completion", {"choices": [{"index": 0, "text": 7}]}),
        ("completion", {"choices": [{"index": 0, "text": "", "finish_reason": 1}]}),
        ("completion", {"choices": [{"index": 0, "text": "x", "prompt_token_ids": [1.5]}]}),
        ("completion", {"choices": [], "usage": 3}),
        ("chat", {"choices": [{"index": 0, "delta": "x"}]}),
        ("chat", {"choices": [{"index": 0, "delta": {"content": ["x"]}}]}),
        ("chat", {"prompt_token_ids": "1 2", "choices": [{"index": 0, "delta": {}}]}),
        ("completion", {"choices": [{"index": 0, "text": "x"}, {"index": 1, "text": "y"}]}),
        ("completion", {"choices": [{"index": 1, "text": "x"}]}),
        ("completion", {"choices": [{"index": "0", "text": "x"}]}),
        ("completion", {"choices": [{"index": 0, "text": "x"}], "usage": []}),
    ],
    ids=[
        "choices-object", "choice-not-object", "ids-strings", "ids-booleans", "ids-not-list",
        "text-number", "finish-number", "prompt-ids-floats", "usage-number", "delta-string",
        "content-list", "chat-prompt-ids-string", "two-choices", "index-one", "index-string",
        "usage-list-beside-a-choice",
    ],
)  # fmt: skip
def test_fields_of_a_type_vllm_never_sends_are_malformed(kind: str, chunk: dict[str, Any]) -> None:
    with pytest.raises(MalformedChunk):
        view_chunk(chunk, kind)  # type: ignore[arg-type]


def test_a_malformed_whole_answer_is_malformed() -> None:
    answer = {"choices": [{"index": 0, "message": {"content": "x"}, "finish_reason": 0}]}
    with pytest.raises(MalformedChunk, match="finish_reason"):
        view_answer(answer, "chat")


def test_a_decode_step_s_chunk_reads_every_field() -> None:
    choice = {"index": 0, "text": "x", "token_ids": [7], "finish_reason": "stop",
              "prompt_token_ids": [1, 2], "logprobs": {"a": 1}}  # fmt: skip
    chunk = {"choices": [choice], "usage": {"n": 1}}
    view = view_chunk(chunk, "completion")
    assert view == ChunkView(True, "x", (7,), "stop", (1, 2), {"n": 1}, False, {"a": 1}, "")
    assert type(view) is ChunkView and view.decisive and not view.rejected


def test_absent_and_null_fields_are_read_as_empty() -> None:
    view = view_chunk({"choices": [{"index": 0, "text": None, "token_ids": None}]}, "completion")
    assert view.has_choice and view.text == "" and view.token_ids is None
    assert not view_chunk({"usage": None}, "chat").has_choice


def _upstream_chunk() -> dict[str, Any]:
    return {
        "id": "upstream",
        "created": 5,
        "prompt_token_ids": [1],
        "usage": None,
        "choices": [
            {"index": 0, "delta": {"content": "x"}, "token_ids": [3], "logprobs": {"a": 1}}
        ],
    }


def test_relay_chunk_rewrites_identity_and_strips_ids() -> None:
    identity = Identity("client-id", 42, "m")
    out = relay_chunk(_upstream_chunk(), identity, keep_ids=False, first=True)
    assert out["id"] == "client-id" and out["created"] == 42
    assert "prompt_token_ids" not in out and "token_ids" not in out["choices"][0]
    assert out["choices"][0]["logprobs"] == {"a": 1} and "usage" not in out
    kept = relay_chunk(_upstream_chunk(), identity, keep_ids=True, first=False)
    assert kept["choices"][0]["token_ids"] == [3] and "prompt_token_ids" not in kept


def test_completion_chunks_render_as_chat_chunks() -> None:
    view = view_chunk({"choices": [{"index": 0, "text": " yo", "token_ids": [5]}]}, "completion")
    out = render_chunk(view, Identity("c", 1, "m"), "chat", keep_ids=False, finish="length")
    assert out["object"] == "chat.completion.chunk"
    assert out["choices"][0]["delta"] == {"content": " yo"}
    assert out["choices"][0]["finish_reason"] == "length"


def test_transcript_merges_legs() -> None:
    request = _request({"model": "m", "prompt": "p", "max_tokens": 10, "return_token_ids": True})
    transcript = Transcript(request)
    first = {
        "id": "a",
        "created": 1,
        "model": "m",
        "choices": [
            {"index": 0, "text": " one", "token_ids": [11], "prompt_token_ids": [1, 2],
             "finish_reason": "cache_threshold"}
        ],
        "usage": {"prompt_tokens": 2, "completion_tokens": 1,
                  "prompt_tokens_details": {"cached_tokens": 1}},
    }  # fmt: skip
    second = {
        "id": "b",
        "choices": [{"index": 0, "text": " two", "token_ids": [12], "finish_reason": "length"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 1},
    }
    transcript.adopt_identity(first)
    transcript.template = first
    for answer, original in ((first, True), (second, False)):
        view = view_answer(answer, "completion")
        transcript.absorb(view, original_prompt=original)
        transcript.absorb_usage(view.usage, original_prompt=original, leg_tokens=1)
    assert transcript.continuation_prompt() == [1, 2, 11, 12]
    assert transcript.remaining == 8
    whole = transcript.whole_answer()
    assert whole["id"] == "a" and whole["choices"][0]["text"] == " one two"
    assert whole["choices"][0]["token_ids"] == [11, 12]
    assert whole["choices"][0]["finish_reason"] == "length"
    assert whole["usage"] == {
        "prompt_tokens": 2,
        "total_tokens": 4,
        "completion_tokens": 2,
        "prompt_tokens_details": {"cached_tokens": 1},
    }
