"""Upstream failures and the one place they become client answers.

Exception tree::

    UpstreamError                 any failure talking to an endpoint
    +-- UpstreamUnavailable       could not connect (refused, reset before a byte)
    +-- UpstreamTimeout           a phase timeout elapsed
    +-- UpstreamStatusError       the endpoint answered a non-2xx status
    +-- UpstreamProtocolError     the answer was not what vLLM sends

:func:`client_error` maps them: a decoder that refuses -> 503, a timeout -> 504,
an upstream 4xx -> the same status and message (the client's input was bad),
anything else -> 502. The message names the endpoint (by its config name, never
its URL) and the phase.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "ClientError",
    "UpstreamError",
    "UpstreamProtocolError",
    "UpstreamStatusError",
    "UpstreamTimeout",
    "UpstreamUnavailable",
    "client_error",
]


class UpstreamError(Exception):
    """A failure talking to ``endpoint`` during ``phase``."""

    def __init__(self, endpoint: str, phase: str, message: str, *, role: str = "") -> None:
        super().__init__(f"{endpoint} ({phase}): {message}")
        self.endpoint = endpoint
        self.phase = phase
        self.message = message
        self.role = role

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


def client_error(exc: UpstreamError) -> ClientError:
    """The client answer for an upstream failure (see the module docstring)."""
    who = f"{exc.role} {exc.endpoint}".strip()
    if isinstance(exc, UpstreamUnavailable):
        status = 503 if exc.role == "decoder" else 502
        return ClientError(status, f"{who} is unavailable during {exc.phase}: {exc.message}")
    if isinstance(exc, UpstreamTimeout):
        return ClientError(504, f"{who} timed out during {exc.phase}")
    if isinstance(exc, UpstreamStatusError) and 400 <= exc.status < 500:
        return ClientError(exc.status, exc.upstream_message)
    return ClientError(502, f"{who} failed during {exc.phase}: {exc.message}")
