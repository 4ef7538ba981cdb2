"""Builders of OpenAI/vLLM response bodies and stream chunks.

Field layout follows vLLM's OpenAI server: completions carry ``choices[0].text``,
chat carries ``choices[0].message`` (``delta`` when streamed). With
``return_token_ids`` a choice carries ``token_ids`` and the prompt's ids ride on
``choices[0].prompt_token_ids`` (completions) or top-level ``prompt_token_ids``
(chat); in a stream, on the first chunk only. ``kv_transfer_params`` is top-level.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pd_orchestrator.model.records import record

__all__ = ["Kind", "Usage", "cached_count", "completion_body", "stream_chunk", "usage_chunk"]

Kind = Literal["completion", "chat"]


@record
class Usage:
    """Token accounting of one answer."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None = None

    def as_dict(self) -> dict[str, Any]:
        details = None if not self.cached_tokens else {"cached_tokens": self.cached_tokens}
        return {
            "prompt_tokens": self.prompt_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "completion_tokens": self.completion_tokens,
            "prompt_tokens_details": details,
        }


def cached_count(usage: object) -> int | None:
    """The cached prompt tokens a ``usage`` object reports in
    ``prompt_tokens_details.cached_tokens`` (None: not reported, or not a count:
    vLLM says it only when started with ``--enable-prompt-tokens-details``)."""
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    if isinstance(cached, int) and not isinstance(cached, bool) and cached >= 0:
        return cached
    return None


def _object(kind: Kind, chunk: bool) -> str:
    if kind == "completion":
        return "text_completion"
    return "chat.completion.chunk" if chunk else "chat.completion"


def completion_body(
    *,
    kind: Kind,
    response_id: str,
    model: str,
    text: str,
    finish_reason: str | None,
    usage: Usage,
    token_ids: list[int] | None = None,
    prompt_token_ids: list[int] | None = None,
    kv_transfer_params: dict[str, Any] | None = None,
    created: int | None = None,
) -> dict[str, Any]:
    """A whole (non-streamed) answer."""
    choice: dict[str, Any] = {"index": 0}
    if kind == "completion":
        choice["text"] = text
    else:
        choice["message"] = {"role": "assistant", "content": text, "tool_calls": []}
    choice |= {"logprobs": None, "finish_reason": finish_reason, "stop_reason": None}
    body: dict[str, Any] = {
        "id": response_id,
        "object": _object(kind, chunk=False),
        "created": created or int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": usage.as_dict(),
    }
    if token_ids is not None:
        choice["token_ids"] = token_ids
        if kind == "completion":
            choice["prompt_token_ids"] = prompt_token_ids
        else:
            body["prompt_token_ids"] = prompt_token_ids
    body["kv_transfer_params"] = kv_transfer_params
    return body


def stream_chunk(
    *,
    kind: Kind,
    response_id: str,
    model: str,
    created: int,
    text: str | None,
    finish_reason: str | None = None,
    role: bool = False,
    token_ids: list[int] | None = None,
    prompt_token_ids: list[int] | None = None,
) -> dict[str, Any]:
    """One streamed chunk. ``role=True`` makes the chat opening chunk (role only)."""
    choice: dict[str, Any] = {"index": 0}
    if kind == "completion":
        choice["text"] = text or ""
    elif role:
        choice["delta"] = {"role": "assistant", "content": ""}
    else:
        choice["delta"] = {} if text is None else {"content": text}
    choice |= {"logprobs": None, "finish_reason": finish_reason}
    if kind == "completion":
        choice["stop_reason"] = None
    chunk: dict[str, Any] = {
        "id": response_id,
        "object": _object(kind, chunk=True),
        "created": created,
        "model": model,
        "choices": [choice],
    }
    if token_ids is not None:
        choice["token_ids"] = token_ids
    if prompt_token_ids is not None:
        if kind == "completion":
            choice["prompt_token_ids"] = prompt_token_ids
        else:
            chunk["prompt_token_ids"] = prompt_token_ids
    return chunk


def usage_chunk(
    *, kind: Kind, response_id: str, model: str, created: int, usage: Usage
) -> dict[str, Any]:
    """The final usage-only chunk of a stream (``stream_options.include_usage``)."""
    return {
        "id": response_id,
        "object": _object(kind, chunk=True),
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage.as_dict(),
    }
