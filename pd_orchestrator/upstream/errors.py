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
* an upstream 400, 404, 413 or 422 -> the same status and the upstream's message,
  which vLLM words about the request's own fields (context length, an unknown
  model, a bad parameter) -- unless it names an address (a URL, ``host:port`` or
  an IP), then the gateway's words instead;
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
    "names_an_address",
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
"""Upstream statuses (about the client's own input) answered with the upstream's message."""

_ADDRESS = re.compile(
    r"[A-Za-z][A-Za-z0-9+.\-]*://"  # a URL
    r"|\b\d{1,3}(?:\.\d{1,3}){3}\b"  # an IPv4 address
    r"|\[[0-9A-Fa-f:.]*:[0-9A-Fa-f:.]*\]"  # a bracketed IPv6 address
    r"|[A-Za-z0-9\-.]+:\d{1,5}\b"  # host:port
)


def names_an_address(message: str) -> bool:
    """Whether ``message`` contains a URL, an IP address or a ``host:port``."""
    return _ADDRESS.search(message) is not None


def client_error(exc: UpstreamError) -> ClientError:
    """The client answer for an upstream failure (see the module docstring)."""
    who = f"{exc.role} {exc.endpoint}".strip()
    if isinstance(exc, UpstreamUnavailable):
        status = 503 if exc.role == "decoder" else 502
        return ClientError(status, f"{who} is unavailable during {exc.phase}")
    if isinstance(exc, UpstreamTimeout):
        return ClientError(504, f"{who} timed out during {exc.phase}")
    if isinstance(exc, UpstreamStatusError):
        message = exc.upstream_message
        if exc.status in PASSED_THROUGH:
            if names_an_address(message):
                message = f"{who} refused the request during {exc.phase} (HTTP {exc.status})"
            return ClientError(exc.status, message)
        return ClientError(502, f"{who} failed during {exc.phase} (HTTP {exc.status})")
    return ClientError(502, f"{who} failed during {exc.phase}")
