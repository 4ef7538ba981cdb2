"""Upstream request bodies derived from the client's (pure; inputs never mutated)."""

from __future__ import annotations

from typing import Any

from pd_orchestrator.flows.request import CHAT_ONLY_FIELDS, ClientRequest

__all__ = ["continuation_body", "leg_body", "with_threshold"]

Json = dict[str, Any]


def leg_body(request: ClientRequest, threshold: float) -> Json:
    """The client's body as a decoder leg sends it.

    Adds the threshold and ``return_token_ids`` (the gateway tracks every token to
    hand a preempted request back); streams always ask for usage, which the
    gateway strips or merges before the client sees it.
    """
    body = request.copy_body()
    body["cache_hit_threshold"] = threshold
    body["return_token_ids"] = True
    if request.stream:
        options = dict(body.get("stream_options") or {})
        options["include_usage"] = True
        body["stream_options"] = options
    return body


def with_threshold(body: Json, threshold: float) -> Json:
    """A shallow copy of ``body`` carrying ``threshold``."""
    return {**body, "cache_hit_threshold": threshold}


def continuation_body(
    request: ClientRequest, token_prompt: list[int], generated: int, threshold: float
) -> Json:
    """A ``/v1/completions`` body that continues ``request`` after ``generated`` tokens.

    The prompt becomes the token ids of the original prompt and of every token
    generated so far; ``max_tokens`` and ``min_tokens`` shrink by ``generated``.
    Chat-only fields are dropped (chat requests continue as token prompts).
    """
    body = {k: v for k, v in request.copy_body().items() if k not in CHAT_ONLY_FIELDS}
    body["prompt"] = token_prompt
    limit = request.max_tokens
    if limit is not None:
        body["max_tokens"] = max(1, limit - generated)
    else:
        body.pop("max_tokens", None)
    if "min_tokens" in body:
        body["min_tokens"] = max(0, int(body["min_tokens"] or 0) - generated)
    body["cache_hit_threshold"] = threshold
    body["return_token_ids"] = True
    if request.stream:
        body["stream_options"] = {"include_usage": True}
    return body
