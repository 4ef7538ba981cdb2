"""Upstream failures and the one place they become client answers.

Exception tree::

    UpstreamError                 any failure talking to an endpoint
    +-- UpstreamUnavailable       could not connect (refused, reset before a byte)
    +-- UpstreamTimeout           a phase timeout elapsed
    +-- UpstreamStatusError       the endpoint answered a non-2xx status
    +-- UpstreamProtocolError     the answer was not what vLLM sends
    +-- GatewayResourceError      the gateway itself ran out of descriptors, socket
                                  buffers or memory to connect: its own fault, never
                                  the endpoint's

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
  access, not the client's input) or an unreadable answer -> 502;
* the gateway's own resources ran out -> 503, in words that name the gateway.
"""

from __future__ import annotations

import re

from pd_orchestrator.model.records import record

__all__ = [
    "PASSED_THROUGH",
    "ClientError",
    "GatewayResourceError",
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
    where it happened (the legs log every failed leg), so it is not logged again.

    Each class says what it means, the one classification every module uses:
    :attr:`retryable` (another endpoint may succeed where this one failed),
    :attr:`endpoint_at_fault` (it counts against the endpoint's health: outlier
    detection, the log level), :attr:`outcome` (the ``outcome`` label of a failed
    leg) and :meth:`client_error` (what the client is told).
    """

    retryable = True
    endpoint_at_fault = True
    gateways_own = False
    """The gateway's own failure: nothing about the endpoint is learnt from it (no
    health or outlier count, no ``upstream_errors_total``)."""
    outcome = "protocol"

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

    @property
    def who(self) -> str:
        """The endpoint as the client may read it: its part and config name."""
        return f"{self.role} {self.endpoint}".strip()

    def client_error(self) -> ClientError:
        """What the client is told (see the module docstring)."""
        return ClientError(502, f"{self.who} failed during {self.phase}")


class UpstreamUnavailable(UpstreamError):
    """The endpoint could not be reached."""

    outcome = "unavailable"

    @property
    def connection_failed(self) -> bool:
        return True

    def client_error(self) -> ClientError:
        status = 503 if self.role == "decoder" else 502
        return ClientError(status, f"{self.who} is unavailable during {self.phase}")


class UpstreamTimeout(UpstreamError):
    """The phase's timeout elapsed."""

    outcome = "timeout"

    def client_error(self) -> ClientError:
        return ClientError(504, f"{self.who} timed out during {self.phase}")


class UpstreamStatusError(UpstreamError):
    """The endpoint answered ``status``: a 5xx is the endpoint's fault and may succeed
    elsewhere; a 4xx is about the request (or the gateway's access) and would not."""

    def __init__(
        self, endpoint: str, phase: str, status: int, message: str, *, role: str = ""
    ) -> None:
        super().__init__(endpoint, phase, f"HTTP {status}: {message}", role=role)
        self.status = status
        self.upstream_message = message
        self.retryable = self.endpoint_at_fault = status >= 500
        self.outcome = "http_4xx" if 400 <= status < 500 else "http_5xx"

    def client_error(self) -> ClientError:
        if self.status in PASSED_THROUGH:
            message = known_refusal(self.upstream_message)
            if message is None:
                message = f"{self.who} refused the request during {self.phase} (HTTP {self.status})"
            return ClientError(self.status, message)
        return ClientError(502, f"{self.who} failed during {self.phase} (HTTP {self.status})")


class UpstreamProtocolError(UpstreamError):
    """The answer could not be understood."""


class GatewayResourceError(UpstreamError):
    """The gateway could not open a connection to the endpoint because it ran out of
    ``resource`` itself (``file_descriptors``: EMFILE/ENFILE, ``socket_buffers``:
    ENOBUFS, ``memory``: ENOMEM). Not the endpoint's doing: another endpoint would
    fail alike, so it is not retried elsewhere either."""

    retryable = False
    endpoint_at_fault = False
    gateways_own = True
    outcome = "gateway_resource"

    def __init__(
        self, endpoint: str, phase: str, message: str, *, role: str = "", resource: str
    ) -> None:
        super().__init__(endpoint, phase, message, role=role)
        self.resource = resource

    def client_error(self) -> ClientError:
        words = self.resource.replace("_", " ")
        return ClientError(503, f"the gateway is out of {words} (its own limit); try again")


@record
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
    return exc.client_error()
