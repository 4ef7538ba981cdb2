"""Authorization: the gateway's own client keys, and what the legs carry upstream.

* :class:`ApiKeys`: with ``auth.api_keys`` configured, every route but the open ones
  (:data:`OPEN_PATHS`: ``/health``, ``/ready``, ``/metrics``, and ``/admin/reload``,
  which has its own token) needs ``Authorization: Bearer <one of the keys>``; the
  answer otherwise is a 401 in the OpenAI error shape. Keys are compared in
  constant time.
* :func:`forwarded_headers`: the client headers every leg of a request carries --
  the client's ``Authorization`` when the gateway has no keys of its own (an
  endpoint whose pool has an ``api_key`` sends that instead: see
  :class:`~pd_orchestrator.flows.legs.Legs`), and the client's ``traceparent`` and
  ``tracestate`` when the gateway does not trace (so vLLM's spans still join the
  client's trace; a tracing gateway sends its leg spans' own).
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Mapping, Sequence

import orjson
from pydantic import SecretStr
from starlette.types import Send

from pd_orchestrator.openai.errors import error_body

__all__ = ["OPEN_PATHS", "ApiKeys", "forwarded_headers", "unauthorized"]

OPEN_PATHS = frozenset({"/health", "/ready", "/metrics", "/admin/reload"})
"""Routes that never ask for a client key."""

_TRACE_HEADERS = ("traceparent", "tracestate")


class ApiKeys:
    """The client keys the gateway accepts."""

    def __init__(self, keys: Sequence[SecretStr]) -> None:
        self._keys = tuple(key.get_secret_value().encode() for key in keys)

    @classmethod
    def configured(cls, keys: Sequence[SecretStr]) -> ApiKeys | None:
        """The keys, or None when there are none (every client is accepted)."""
        return cls(keys) if keys else None

    def allows(self, headers: Iterable[tuple[bytes, bytes]]) -> bool:
        """Whether raw ASGI ``headers`` carry ``Authorization: Bearer <a key>``."""
        for name, value in headers:
            if name.lower() == b"authorization":
                scheme, _, token = value.strip().partition(b" ")
                if scheme.lower() != b"bearer":
                    return False
                token = token.strip()
                matched = False
                for key in self._keys:  # no early exit: every key is compared
                    matched |= secrets.compare_digest(token, key)
                return matched
        return False


async def unauthorized(send: Send) -> None:
    """A 401 answer in the OpenAI error shape."""
    body = orjson.dumps(error_body("a valid API key is required (Authorization: Bearer)", 401))
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", b"%d" % len(body)),
        (b"www-authenticate", b"Bearer"),
    ]
    await send({"type": "http.response.start", "status": 401, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def forwarded_headers(
    headers: Mapping[str, str], *, own_keys: bool, tracing: object
) -> dict[str, str] | None:
    """The client headers each leg carries (see the module docstring); None if none.

    ``own_keys``: the gateway checks client keys; ``tracing``: the request's trace
    (None when the gateway does not trace)."""
    forward: dict[str, str] | None = None
    if not own_keys:
        authorization = headers.get("authorization")
        if authorization is not None:
            forward = {"authorization": authorization}
    if tracing is None and "traceparent" in headers:
        forward = forward or {}
        for name in _TRACE_HEADERS:
            value = headers.get(name)
            if value is not None:
                forward[name] = value
    return forward
