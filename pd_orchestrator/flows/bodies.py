"""Upstream request bodies derived from the client's (pure; inputs never mutated).

Bodies are shallow copies of the client's body with top-level fields set or
replaced; nested values are shared and never changed, so no body is deep-copied on
the request path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pd_orchestrator.flows.logprobs import continuation_logprobs
from pd_orchestrator.flows.request import CHAT_ONLY_FIELDS, ClientRequest
from pd_orchestrator.openai.responses import Kind

__all__ = ["COMPLETIONS", "Route", "continuation_body", "leg_body", "with_threshold"]

Json = dict[str, Any]
COMPLETIONS = "/v1/completions"


def _streaming(body: Json, stream: bool, client_options: Any) -> None:
    """Make ``body`` stream with usage when ``stream`` (the gateway strips or merges
    usage before the client sees it), else answer whole."""
    if not stream:
        body["stream"] = False
        body.pop("stream_options", None)
        return
    options = dict(client_options) if isinstance(client_options, dict) else {}
    options["include_usage"] = True
    body["stream"] = True
    body["stream_options"] = options


def leg_body(
    request: ClientRequest,
    threshold: float,
    *,
    stream: bool | None = None,
    admission_only: bool = False,
) -> Json:
    """The client's body as a decoder leg sends it.

    Adds the threshold (``admission_only``: applied at admission only, as
    ``cache_hit_admission_only``) and ``return_token_ids`` (the gateway tracks every
    token to hand a preempted request back). ``stream`` (default: as the client
    asked) says whether the leg streams; a streamed leg always asks for usage.
    """
    body = dict(request.body)
    body["cache_hit_threshold"] = threshold
    if admission_only:
        body["cache_hit_admission_only"] = True
    body["return_token_ids"] = True
    _streaming(body, request.stream if stream is None else stream, body.get("stream_options"))
    return body


def with_threshold(body: Json, threshold: float) -> Json:
    """A shallow copy of ``body`` carrying ``threshold``."""
    return {**body, "cache_hit_threshold": threshold}


def continuation_body(
    request: ClientRequest,
    token_prompt: list[int],
    generated: int,
    threshold: float,
    *,
    stream: bool | None = None,
) -> Json:
    """A ``/v1/completions`` body that continues ``request`` after ``generated`` tokens.

    The prompt becomes the token ids of the original prompt and of every token
    generated so far; ``max_tokens`` and ``min_tokens`` shrink by ``generated``.
    Chat-only fields are dropped (chat requests continue as token prompts); a
    structured output's constraint (``response_format``, ``structured_outputs``: both
    APIs take them) stays, with ``cache_hit_resume_tokens`` = ``generated`` so the
    decoder advances its grammar over the generated tokens first (only for a
    :attr:`~ClientRequest.resumable` request: an older plugin is never sent the field).
    Logprobs are asked as completions asks them (:func:`continuation_logprobs`). A
    named tool choice continues as ``structured_outputs.json`` of the tool's parameters.
    ``stream`` as in :func:`leg_body`.
    """
    body = {k: v for k, v in request.body.items() if k not in CHAT_ONLY_FIELDS}
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
    named = request.named_tool
    if named is not None:  # as vLLM's chat API constrains it
        body["structured_outputs"] = {"json": named.parameters}
    if generated and request.resumable:
        body["cache_hit_resume_tokens"] = generated
    logprobs = continuation_logprobs(request.body, request.kind)
    if logprobs is not None:
        body["logprobs"] = logprobs
    _streaming(body, request.stream if stream is None else stream, None)
    return body


@dataclass(frozen=True, slots=True)
class Route:
    """How the legs of a request's original prompt go: as the client sent it (``ids``
    None: its own path, API and body), or as ``ids``, the prompt's token ids, on
    ``/v1/completions`` (the answer re-rendered in the client's API)."""

    path: str
    kind: Kind
    ids: list[int] | None = None

    @classmethod
    def of(cls, request: ClientRequest, ids: list[int] | None = None) -> Route:
        """The client's route, or token ids on ``/v1/completions`` when ``ids``."""
        if ids is None:
            return cls(request.path, request.kind)
        return cls(COMPLETIONS, "completion", ids)

    def body(
        self, request: ClientRequest, threshold: float, *, stream: bool, admission_only: bool
    ) -> Json:
        """A decoder leg's body for the original prompt (:func:`leg_body`, or
        :func:`continuation_body` of no generated token: only a continuable request,
        which is never admission-only, goes as ids)."""
        if self.ids is None:
            return leg_body(request, threshold, stream=stream, admission_only=admission_only)
        return continuation_body(request, self.ids, 0, threshold, stream=stream)
