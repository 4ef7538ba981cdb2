"""Upstream request bodies derived from the client's (pure; inputs never mutated).

Bodies are shallow copies of the client's body with top-level fields set or
replaced; nested values are shared and never changed, so no body is deep-copied on
the request path. :class:`SharedEncoding` encodes them for the wire: the client's
large top-level values (its prompt or messages, say) once per request, shared by
every leg of every choice, each leg's own fields around them.
"""

from __future__ import annotations

from typing import Any

import orjson

from pd_orchestrator.flows.logprobs import continuation_logprobs
from pd_orchestrator.flows.request import CHAT_ONLY_FIELDS, ClientRequest
from pd_orchestrator.model.records import record
from pd_orchestrator.openai.responses import Kind

__all__ = [
    "COMPLETIONS",
    "SHARED_BYTES",
    "Encoded",
    "Route",
    "SharedEncoding",
    "continuation_body",
    "leg_body",
    "with_threshold",
]

Json = dict[str, Any]
COMPLETIONS = "/v1/completions"
SHARED_BYTES = 16384
"""The encoded size from which a top-level value of the client's body is encoded once
per request and shared by its legs (smaller ones are encoded with each leg)."""
Encoded = tuple[bytes, ...]
"""A body encoded as JSON in pieces, to be sent one after the other."""
_SHAREABLE = frozenset({str, list, dict})
_JSON_CHAR_BYTES = 6
"""The most bytes one character of a string takes in JSON (``\\u001f``)."""


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


@record
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


class SharedEncoding:
    """Encodes the leg bodies of one client request (its body: ``source``), every large
    top-level value of ``source`` once.

    A leg body's field whose value *is* ``source``'s (the same object: bodies are
    shallow copies, nested values never changed) and encodes to ``least`` bytes or
    more is sent as that one encoding; the leg's other fields are encoded around it.
    So the ``n`` choices of a request, and the attempt, prefill and decode legs of
    each, share one copy of the prompt's bytes instead of one each.
    """

    def __init__(self, source: Json, least: int = SHARED_BYTES) -> None:
        self._source = source
        self._least = least
        self._pieces: dict[str, tuple[bytes, bytes] | None] = {}

    def encode(self, body: Json) -> Encoded:
        """``body`` as JSON: its own fields, then each shared ``"key":value`` (one
        object, its fields in another order than ``body``'s)."""
        shared: list[tuple[bytes, bytes]] = []
        own: Json = {}
        for key, value in body.items():
            piece = self._piece(key, value) if type(value) in _SHAREABLE else None
            if piece is None:
                own[key] = value
            else:
                shared.append(piece)
        head = orjson.dumps(own)
        if not shared:
            return (head,)
        pieces = [head[:-1] + b"," if own else b"{"]
        for name, value in shared:
            pieces += (name, value, b",")
        pieces[-1] = b"}"
        return tuple(pieces)

    def _piece(self, key: str, value: Any) -> tuple[bytes, bytes] | None:
        """``"key":`` and ``value`` encoded once, when ``value`` is the source's and
        large."""
        if self._source.get(key) is not value:
            return None
        if type(value) is str and _JSON_CHAR_BYTES * len(value) + 2 < self._least:
            return None  # small however it encodes: not encoded twice to find out
        if key not in self._pieces:
            encoded = orjson.dumps(value)
            large = len(encoded) >= self._least
            self._pieces[key] = (orjson.dumps(key) + b":", encoded) if large else None
        return self._pieces[key]
