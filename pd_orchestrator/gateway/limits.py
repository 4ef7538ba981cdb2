"""Limits on what a client sends, each checked before the work it protects.

Every check raises :class:`~pd_orchestrator.flows.sink.GatewayError` (answered in the
OpenAI error shape); the limits are :class:`~pd_orchestrator.config.settings.LimitsConfig`.

* :func:`check_head` -- first thing for every HTTP request: header count and bytes
  (431), and a declared ``Content-Length`` above the body limit (413, before a byte
  of the body is read). The server's protocol
  (:mod:`~pd_orchestrator.gateway.protocol`) enforces the same head limits while
  the head arrives; this check holds under any ASGI server.
* :func:`read_body` -- reads the body up to the limit and refuses it (413) as soon
  as it passes, so nothing is buffered beyond it.
* :func:`check_json` -- on the decoded body of every route that takes one (the
  completion routes, ``/tokenize``, ``/detokenize``), before it is validated or
  forwarded: chat messages and token ids (a prompt's, ``/detokenize``'s
  ``tokens``), then nesting depth (400). The depth walk visits containers only and
  skips a completion's ``prompt`` (which validation then allows to be a string or a
  flat list of token ids only, however long), so a plain completion body costs
  about a microsecond and a 100-message chat some tens.
* :func:`check_choices` -- on the validated request: ``n`` times the body's size
  (400): each choice is a request of its own upstream, with its own copy of the body.
"""

from __future__ import annotations

from typing import Any, Literal

from starlette.types import Receive, Scope

from pd_orchestrator.config.settings import LimitsConfig
from pd_orchestrator.flows.sink import GatewayError, check_token_ids

__all__ = [
    "REFUSALS_THAT_CLOSE",
    "BodyKind",
    "check_choices",
    "check_head",
    "check_json",
    "json_depth_exceeds",
    "read_body",
]

REFUSALS_THAT_CLOSE = frozenset({413, 431})
"""Statuses answered with ``connection: close`` (the rest of the request is unread)."""

_MAX_LENGTH_DIGITS = 19
_CONTAINERS = frozenset({dict, list})

BodyKind = Literal["completion", "chat", "tokenize", "detokenize"]
"""What a request body is: a completion or chat request, or a ``/tokenize`` or
``/detokenize`` body."""


def check_head(scope: Scope, limits: LimitsConfig) -> None:
    """Refuse a request head over the limits (431) or a declared body over them (413)."""
    headers = scope["headers"]
    if len(headers) > limits.max_headers:
        raise GatewayError(431, f"the request has more than {limits.max_headers} headers")
    size = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"")
    length = None
    for name, value in headers:
        size += len(name) + len(value)
        if name == b"content-length":
            length = value
    if size > limits.max_header_bytes:
        raise GatewayError(431, f"the request head exceeds {limits.max_header_bytes} bytes")
    if length is not None and _declared(length) > limits.max_body_bytes:
        raise GatewayError(413, _too_large(limits.max_body_bytes))


def _declared(length: bytes) -> int:
    """A ``Content-Length`` value (0 if not a number: the server refuses those)."""
    if len(length) > _MAX_LENGTH_DIGITS:
        return 1 << 64
    return int(length) if length.isdigit() else 0


def _too_large(limit: int) -> str:
    return f"the request body exceeds {limit} bytes"


async def read_body(receive: Receive, limit: int) -> bytes:
    """The request body; 413 as soon as it passes ``limit``, 499 if the client left."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise GatewayError(499, "the client disconnected")
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise GatewayError(413, _too_large(limit))
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def json_depth_exceeds(body: dict[str, Any], limit: int, skip: str = "") -> bool:
    """Whether ``body`` nests deeper than ``limit`` (the body itself is level 1),
    not looking inside its ``skip`` field. Level by level, containers only: no
    recursion, whatever the depth."""
    level = [v for k, v in body.items() if k != skip and type(v) in _CONTAINERS]
    depth = 1
    while level:
        depth += 1
        if depth > limit:
            return True
        level = [
            child
            for node in level
            for child in (node.values() if type(node) is dict else node)
            if type(child) in _CONTAINERS
        ]
    return False


def check_json(body: dict[str, Any], limits: LimitsConfig, kind: BodyKind) -> None:
    """Refuse a decoded body of ``kind`` that carries too many messages or token ids
    (``prompt``; ``tokens`` for ``/detokenize``), or nests too deep (400), before it
    is validated or forwarded. The counts come first: they bound the depth walk."""
    ids = "tokens" if kind == "detokenize" else "prompt"
    found = body.get(ids)
    if type(found) is list:
        check_token_ids(len(found), limits.max_prompt_token_ids, ids)
    messages = body.get("messages")
    if type(messages) is list and len(messages) > limits.max_messages:
        raise GatewayError(
            400, f"the request has more than {limits.max_messages} messages", "messages"
        )
    if json_depth_exceeds(body, limits.max_json_depth, "prompt" if kind == "completion" else ""):
        raise GatewayError(400, f"the JSON body nests deeper than {limits.max_json_depth} levels")


def check_choices(n: int, size: int, limits: LimitsConfig) -> None:
    """Refuse ``n`` > 1 choices of a ``size``-byte body past ``limits.max_n_body_bytes``
    (400)."""
    limit = limits.max_n_body_bytes
    if n > 1 and n * size > limit:
        message = f"n={n} times the body's {size} bytes exceeds {limit} bytes: ask fewer choices"
        raise GatewayError(400, message, "n")
