"""The HTTP/1.1 protocol the gateway serves on: uvicorn's httptools protocol with
limits on the request head, and its own refusals in the OpenAI error shape.

uvicorn's httptools protocol keeps whatever head a client sends (llhttp has no
limit: a 50 MB header value is buffered whole before the application sees it).
:func:`limited_protocol` makes a subclass that counts the head as it arrives:

* the request line and each header (names plus values) against
  ``limits.max_header_bytes``, and headers against ``limits.max_headers``, as the
  parser reports them;
* the raw bytes of a head still incomplete, so a head that never ends (one huge
  header value) is cut after at most one network read past twice the limit (the
  raw head also holds separators and line ends, which the limit does not count).

Either answers 431 and closes the connection. A request the parser cannot read
is answered 400 (uvicorn's plain-text answer, rewritten). Both answers are
``{"error": {"message", "type", "param", "code"}}``. The limits are read at the
start of each request, so a reload applies them to the next one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from http import HTTPStatus
from typing import Any

import orjson
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from pd_orchestrator.config.settings import LimitsConfig
from pd_orchestrator.openai.errors import error_body

__all__ = ["error_bytes", "limited_protocol"]


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


def limited_protocol(limits: Callable[[], LimitsConfig]) -> type[asyncio.Protocol]:
    """An httptools protocol class that enforces the head limits ``limits()`` gives."""

    class LimitedHttpToolsProtocol(HttpToolsProtocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._in_head = True
            self._unparsed = 0
            self._head_bytes = 0
            self._head_count = 0
            self._refusal: tuple[int, str] | None = None
            self._limits = limits()

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

        def on_url(self, url: bytes) -> None:
            self._count(len(url), 0)
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._count(len(name) + len(value), 1)
            super().on_header(name, value)

        def on_headers_complete(self) -> None:
            self._in_head = False
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            self._in_head = True
            self._unparsed = 0
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

        def send_400_response(self, msg: str) -> None:
            status, message = self._refusal or (400, "the request is not valid HTTP/1.1")
            self._refuse(status, message)

        def _refuse(self, status: int, message: str) -> None:
            self.transport.write(error_bytes(status, message))
            self.transport.close()

    return LimitedHttpToolsProtocol
