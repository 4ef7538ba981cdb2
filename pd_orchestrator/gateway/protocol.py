"""The HTTP/1.1 protocol the gateway serves on: uvicorn's httptools protocol with
limits on the request head, on how long a connection may hold the gateway, and on
how many connections are open, with its own refusals in the OpenAI error shape.

uvicorn's httptools protocol keeps whatever head a client sends (llhttp has no
limit: a 50 MB header value is buffered whole before the application sees it),
waits for a head or a body as long as the client likes, and takes every
connection until the process runs out of file descriptors.
:func:`limited_protocol` makes a subclass that:

* counts the head as it arrives: the request line and each header (names plus
  values) against ``limits.max_header_bytes``, and headers against
  ``limits.max_headers``, as the parser reports them; and the raw bytes of a head
  still incomplete, so a head that never ends (one huge header value) is cut after
  at most one network read past twice the limit (the raw head also holds
  separators and line ends, which the limit does not count) -- 431;
* gives the head ``limits.header_timeout`` seconds (from the connection's opening,
  or from the first byte of a later request) and the body ``limits.body_timeout``
  (from the end of the head to its last byte) -- 408 when the request was begun and
  nothing was answered yet; a connection that sent nothing is closed without a word,
  and one whose answer had begun is closed;
* closes a connection idle between requests after ``limits.keepalive_timeout``
  (uvicorn's keep-alive timer);
* answers a connection opened past ``limits.max_connections`` (default: half the
  process's open-file limit) 503 at once and closes it.

Each refusal closes the connection. A request the parser cannot read is answered
400 (uvicorn's plain-text answer, rewritten). Every answer is
``{"error": {"message", "type", "param", "code"}}``. The limits are read when a
connection opens and at the start of each request, so a reload applies them to the
next one.

The two timeouts share one timer per connection, armed lazily: a request moves a
deadline (a float), and the timer, when it fires early, re-arms itself for the
deadline it finds -- no timer is created or cancelled per request.
"""

from __future__ import annotations

import asyncio
import resource
from collections.abc import Callable
from http import HTTPStatus
from typing import Any, Literal

import orjson
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from pd_orchestrator.config.settings import LimitsConfig
from pd_orchestrator.openai.errors import error_body

__all__ = ["TOO_MANY_CONNECTIONS", "default_max_connections", "error_bytes", "limited_protocol"]

TOO_MANY_CONNECTIONS = "the gateway has too many connections open; try again"
_Waiting = Literal["request", "head", "body"]
"""What a connection's deadline waits for: a first request (nothing sent yet), the
rest of a head, the rest of a body."""


class _HeadRefused(Exception):
    """Raised inside a parser callback to stop parsing a head over the limits."""


def error_bytes(status: int, message: str) -> bytes:
    """A whole HTTP/1.1 error answer (JSON body, ``connection: close``)."""
    body = orjson.dumps(error_body(message, status))
    head = (
        b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
        b"connection: close\r\n\r\n" % (status, HTTPStatus(status).phrase.encode(), len(body))
    )
    return head + body


def default_max_connections() -> int:
    """The connection cap when ``limits.max_connections`` is unset: half the process's
    open-file limit (the other half stays for upstream connections and files)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 1 << 16
    return max(1, soft // 2)


def limited_protocol(limits: Callable[[], LimitsConfig]) -> type[asyncio.Protocol]:
    """An httptools protocol class that enforces the limits ``limits()`` gives."""
    default_cap = default_max_connections()

    class LimitedHttpToolsProtocol(HttpToolsProtocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._in_head = True
            self._unparsed = 0
            self._head_bytes = 0
            self._head_count = 0
            self._refusal: tuple[int, str] | None = None
            self._limits = limits()
            self.timeout_keep_alive = self._limits.keepalive_timeout  # type: ignore[assignment]
            self._waiting: _Waiting = "request"
            self._deadline: float | None = None
            self._timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > (self._limits.max_connections or default_cap):
                self._refuse(503, TOO_MANY_CONNECTIONS)
                return
            self._expect("request", self._limits.header_timeout)

        def connection_lost(self, exc: Exception | None) -> None:
            self._deadline = None
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._in_head:
                self._unparsed += len(data)
            super().data_received(data)
            limit = self._limits.max_header_bytes
            if self._in_head and self._unparsed > 2 * limit and not self.transport.is_closing():
                self._refuse(431, f"the request head exceeds {limit} bytes")

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._limits = limits()
            self._head_bytes = self._head_count = 0
            self._refusal = None
            if self._deadline is None:  # a later request: its head's time starts now
                self._expect("head", self._limits.header_timeout)
            self._waiting = "head"

        def on_url(self, url: bytes) -> None:
            self._count(len(url), 0)
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._count(len(name) + len(value), 1)
            super().on_header(name, value)

        def on_headers_complete(self) -> None:
            self._in_head = False
            super().on_headers_complete()
            self._expect("body", self._limits.body_timeout)

        def on_message_complete(self) -> None:
            self._in_head = True
            self._unparsed = 0
            self._deadline = None
            super().on_message_complete()

        def _count(self, size: int, headers: int) -> None:
            self._head_bytes += size
            self._head_count += headers
            limits = self._limits
            if self._head_count > limits.max_headers:
                self._refusal = (431, f"the request has more than {limits.max_headers} headers")
            elif self._head_bytes > limits.max_header_bytes:
                self._refusal = (431, f"the request head exceeds {limits.max_header_bytes} bytes")
            if self._refusal is not None:
                raise _HeadRefused  # the parser stops; data_received answers

        def _expect(self, waiting: _Waiting, seconds: float) -> None:
            """Give what the connection waits for ``seconds`` from now."""
            self._waiting = waiting
            self._deadline = self.loop.time() + seconds
            if self._timer is None:
                self._timer = self.loop.call_at(self._deadline, self._check)

        def _check(self) -> None:
            """The timer: re-armed for a deadline that moved, else the wait timed out."""
            self._timer = None
            deadline = self._deadline
            if deadline is None or self.transport.is_closing():
                return
            if self.loop.time() < deadline:
                self._timer = self.loop.call_at(deadline, self._check)
                return
            self._timed_out()

        def _timed_out(self) -> None:
            """408 for a request begun and not answered yet; otherwise close quietly
            (nothing was sent, or an answer is already under way)."""
            cycle, limits = self.cycle, self._limits
            if self._waiting == "head" and (cycle is None or cycle.response_complete):
                self._refuse(408, f"the request head took more than {limits.header_timeout:g} s")
            elif self._waiting == "body" and cycle is not None and not cycle.response_started:
                cycle.disconnected = True  # the application's receive() tells it; sends drop
                cycle.message_event.set()
                self._refuse(408, f"the request body took more than {limits.body_timeout:g} s")
            else:
                self.transport.close()

        def send_400_response(self, msg: str) -> None:
            status, message = self._refusal or (400, "the request is not valid HTTP/1.1")
            self._refuse(status, message)

        def _refuse(self, status: int, message: str) -> None:
            self.transport.write(error_bytes(status, message))
            self.transport.close()

    return LimitedHttpToolsProtocol
