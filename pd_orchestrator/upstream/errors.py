"""Upstream failures and the one place they become client answers.

Exception tree::

    UpstreamError                 any failure talking to an endpoint
    +-- UpstreamUnavailable       could not connect (refused, reset before a byte)
    +-- UpstreamTimeout           a phase timeout elapsed
    +-- UpstreamStatusError       the endpoint answered a non-2xx status
    +-- UpstreamProtocolError     the answer was not what vLLM sends

:func:`client_error` maps them to what the client is told, in the gateway's own
words: the endpoint by its config name (never its URL), its part and the phase,
never the upstream's text (the gateway logs that):

* could not connect -> 503 for a decoder, 502 for a prefiller, the same message
  whatever the cause (refused, reset, unreachable: a client cannot tell an open
  port from a closed one);
* a timeout -> 504;
* an upstream 400, 404, 413 or 422 (about the request's own fields) -> the same
  status, and the gateway's words for it -- except vLLM's few refusals a client can
  act on, recognised by their form and rewritten by the gateway from the numbers
  they state (:func:`known_refusal`): only those numbers pass, so no host, path,
  address, HTML or traceback an upstream writes can reach the client;
* any other status (5xx; 401/403/429 and the like are about the gateway's own
  access, not the client's input) or an unreadable answer -> 502.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = [
    "PASSED_THROUGH",
    "ClientError",
    "UpstreamError",
    "UpstreamProtocolError",
    "UpstreamStatusError",
    "UpstreamTimeout",
    "UpstreamUnavailable",
    "client_error",
    "known_refusal",
]


class UpstreamError(Exception):
    """A failure talking to ``endpoint`` during ``phase``. ``logged``: it was logged
    where it happened (the legs log every failed leg), so it is not logged again."""

    def __init__(self, endpoint: str, phase: str, message: str, *, role: str = "") -> None:
        super().__init__(f"{endpoint} ({phase}): {message}")
        self.endpoint = endpoint
        self.phase = phase
        self.message = message
        self.role = role
        self.logged = False

    @property
    def connection_failed(self) -> bool:
        """No connection could be made (the endpoint looks down)."""
        return False


class UpstreamUnavailable(UpstreamError):
    """The endpoint could not be reached."""

    @property
    def connection_failed(self) -> bool:
        return True


class UpstreamTimeout(UpstreamError):
    """The phase's timeout elapsed."""


class UpstreamStatusError(UpstreamError):
    """The endpoint answered ``status``."""

    def __init__(
        self, endpoint: str, phase: str, status: int, message: str, *, role: str = ""
    ) -> None:
        super().__init__(endpoint, phase, f"HTTP {status}: {message}", role=role)
        self.status = status
        self.upstream_message = message

    @property
    def retryable(self) -> bool:
        return self.status in (502, 503, 504)


class UpstreamProtocolError(UpstreamError):
    """The answer could not be understood."""


@dataclass(frozen=True, slots=True)
class ClientError:
    """What the client gets: an HTTP status and a message."""

    status: int
    message: str
    param: str | None = None


PASSED_THROUGH = frozenset({400, 404, 413, 422})
"""Upstream statuses (about the client's own input) the client gets as they are."""

_NUMBER = r"(?<!\d)(\d{1,10})(?!\d)"
_CONTEXT = re.compile(r"maximum (?:context|model) length (?:is|of) " + _NUMBER)
_INPUT = re.compile(
    _NUMBER + r" input tokens"
    r"|prompt \(length " + _NUMBER + r"\)"
    r"|prompt has " + _NUMBER + r" tokens"
    r"|\(" + _NUMBER + r" in the messages"
)
_OUTPUT = re.compile(
    r"too large: " + _NUMBER + r"|" + _NUMBER + r" in the completion"
    r"|requested " + _NUMBER + r" output tokens"
)
_FIXED = frozenset({"The decoder prompt cannot be empty"})
"""vLLM refusals without a variable part: passed as they are, when equal."""


def _number(pattern: re.Pattern[str], message: str) -> int | None:
    found = pattern.search(message)
    return None if found is None else int(next(g for g in found.groups() if g is not None))


def known_refusal(message: str) -> str | None:
    """The client's words for a vLLM refusal it can act on, or None.

    A message equal to one of vLLM's fixed refusals (an empty prompt) is kept. A
    context-length refusal -- any of vLLM's wordings: ``maximum context length is L
    tokens`` or ``maximum model length of L``, with the prompt's and the requested
    output's token counts when it states them -- is rewritten from those numbers
    alone. Anything else is None: the caller answers in its own words.
    """
    if message in _FIXED:
        return message
    context = _number(_CONTEXT, message)
    if context is None:
        return None
    words = f"This model's maximum context length is {context} tokens"
    prompt, output = _number(_INPUT, message), _number(_OUTPUT, message)
    if prompt is not None:
        words += f"; the request has {prompt} input tokens"
        if output is not None:
            words += f" and asks for {output} output tokens"
    elif output is not None:
        words += f"; the request asks for {output} output tokens"
    return words + ". Reduce the prompt or max_tokens."


def client_error(exc: UpstreamError) -> ClientError:
    """The client answer for an upstream failure (see the module docstring)."""
    who = f"{exc.role} {exc.endpoint}".strip()
    if isinstance(exc, UpstreamUnavailable):
        status = 503 if exc.role == "decoder" else 502
        return ClientError(status, f"{who} is unavailable during {exc.phase}")
    if isinstance(exc, UpstreamTimeout):
        return ClientError(504, f"{who} timed out during {exc.phase}")
    if isinstance(exc, UpstreamStatusError):
        if exc.status in PASSED_THROUGH:
            message = known_refusal(exc.upstream_message)
            if message is None:
                message = f"{who} refused the request during {exc.phase} (HTTP {exc.status})"
            return ClientError(exc.status, message)
        return ClientError(502, f"{who} failed during {exc.phase} (HTTP {exc.status})")
    return ClientError(502, f"{who} failed during {exc.phase}")
