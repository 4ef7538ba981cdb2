"""The ``/tokenize`` request for a completion request's prompt (pure).

vLLM's ``POST /tokenize`` takes a completions prompt (``prompt``) or chat messages
(``messages``) and answers with the token ids its completions or chat route would
compute for them. :func:`tokenize_body` builds that request from a client's body,
carrying every field that changes the result: ``add_special_tokens`` for a prompt;
for messages, the fields that change how the chat template renders them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["CHAT_TEMPLATE_FIELDS", "token_ids", "tokenize_body"]

CHAT_TEMPLATE_FIELDS = (
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "chat_template",
    "chat_template_kwargs",
    "mm_processor_kwargs",
    "tools",
)
"""Chat fields vLLM's ``/tokenize`` reads besides the messages (absent ones keep
vLLM's defaults, the same as its chat route's)."""


def tokenize_body(body: Mapping[str, Any], *, chat: bool) -> dict[str, Any] | None:
    """The ``/tokenize`` body for ``body``'s prompt; None when it has no text prompt
    (chat without a ``messages`` list, or a completions prompt that is not a string)."""
    request: dict[str, Any] = {"model": body.get("model")}
    if chat:
        if not isinstance(body.get("messages"), list):
            return None
        request["messages"] = body["messages"]
        for name in CHAT_TEMPLATE_FIELDS:
            if name in body:
                request[name] = body[name]
        return request
    if not isinstance(body.get("prompt"), str):
        return None
    request["prompt"] = body["prompt"]
    if "add_special_tokens" in body:
        request["add_special_tokens"] = body["add_special_tokens"]
    return request


def token_ids(answer: Mapping[str, Any] | None) -> list[int] | None:
    """The token ids of a ``/tokenize`` answer; None unless they are a non-empty list
    of non-negative ints."""
    tokens = None if answer is None else answer.get("tokens")
    if not isinstance(tokens, list) or not tokens:
        return None
    if not all(type(t) is int and t >= 0 for t in tokens):
        return None
    return tokens
