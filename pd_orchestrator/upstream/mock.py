"""A transport for tests: answers from a plain function instead of a socket.

:class:`MockTransport` satisfies :class:`~pd_orchestrator.upstream.transport.Transport`;
each request gets ``handler(request)``, a :class:`MockResponse` (or an awaitable of
one), and a handler may raise a
:class:`~pd_orchestrator.upstream.transport.TransportError` to act out a failure. Kept
apart from the socket transport, which is compiled (setup.py), since mypyc builds no
async generator.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import orjson

from pd_orchestrator.upstream.transport import Request, Response, Timeouts

__all__ = ["MockHandler", "MockResponse", "MockTransport"]


@dataclass
class MockResponse:
    """A scripted answer: ``body`` whole, or ``chunks`` (bytes, or an async iterable of
    bytes that may sleep or raise) as the pieces of the body; ``json`` and ``text``
    are shorthands for ``body``."""

    status: int = 200
    json: Any = None
    text: str | None = None
    body: bytes | None = None
    chunks: Iterable[bytes] | AsyncIterator[bytes] | None = None
    headers: list[tuple[str, str]] = field(default_factory=list)

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._pieces()

    async def _pieces(self) -> AsyncIterator[bytes]:
        if self.chunks is None:
            yield self._body()
            return
        if isinstance(self.chunks, AsyncIterator):
            async for piece in self.chunks:
                yield piece
            return
        for piece in self.chunks:
            yield piece

    def _body(self) -> bytes:
        if self.body is not None:
            return self.body
        if self.text is not None:
            return self.text.encode()
        return orjson.dumps(self.json) if self.json is not None else b""

    async def read(self) -> bytes:
        return b"".join([piece async for piece in self])

    async def aclose(self) -> None:
        aclose = getattr(self.chunks, "aclose", None)
        if aclose is not None:
            await aclose()


MockHandler = Callable[[Request], "MockResponse | Awaitable[MockResponse]"]


class MockTransport:
    """Answers every request with ``handler(request)`` (which may be async and may raise
    a :class:`TransportError` to simulate a failure). ``requests`` records what was sent."""

    def __init__(self, handler: MockHandler) -> None:
        self.handler = handler
        self.requests: list[Request] = []

    async def send(self, request: Request, timeouts: Timeouts) -> Response:
        self.requests.append(request)
        outcome = self.handler(request)
        if not isinstance(outcome, MockResponse):
            outcome = await outcome
        return outcome

    async def aclose(self) -> None:
        return None
