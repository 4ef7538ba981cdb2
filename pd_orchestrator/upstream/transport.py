"""HTTP/1.1 to the upstream instances: a small client on asyncio and httptools.

The gateway's cost per request was dominated by its HTTP client, so the legs use
this one: a keep-alive pool per origin, one write per request, the response parsed
by httptools (llhttp) as bytes arrive, bodies read whole or piece by piece.

Contract:

* :meth:`HttpTransport.send` returns once the status line and headers arrived; the
  caller then reads the body (:meth:`Response.read` or ``async for piece in
  response``) and must :meth:`Response.aclose` it. A response read to its end goes
  back to the pool when the server allows keep-alive; closing one early closes its
  connection (that is how vLLM learns to abort a request).
* Failures raise :class:`TransportError` subclasses: :class:`ConnectFailed` (no
  connection; nothing was sent), :class:`ReadTimedOut` (no byte within the read
  timeout), :class:`PoolTimedOut` (no connection slot within the pool timeout),
  :class:`ConnectionBroken` (the peer closed or sent something that is not HTTP) and
  :class:`OutOfResources` (this process could not make a socket: out of file
  descriptors, socket buffers or memory -- its own limit, not the peer's doing).
* A request that fails on a reused keep-alive connection before any byte of an
  answer is sent again once on a new connection (the server closed the idle
  connection as the request left). Idle connections expire after
  ``keepalive_expiry`` seconds, before servers usually close them (uvicorn: 5 s).
* Reading pauses the socket while more than ``HIGH_WATER`` bytes wait unread, so a
  slow client holds back the upstream rather than the gateway's memory.

:class:`~pd_orchestrator.upstream.mock.MockTransport` answers from a plain function
instead of a socket (tests).
"""

from __future__ import annotations

import asyncio
import errno
import ssl
import time
from collections import deque
from collections.abc import AsyncIterator, Sequence
from typing import Any, Protocol, cast
from urllib.parse import urlsplit

import httptools
import orjson

from pd_orchestrator.model.records import record

__all__ = [
    "ConnectFailed",
    "ConnectionBroken",
    "HttpTransport",
    "Origin",
    "OutOfResources",
    "PoolTimedOut",
    "ReadTimedOut",
    "Request",
    "Response",
    "Timeouts",
    "Transport",
    "TransportError",
    "own_resource",
]

HIGH_WATER = 1 << 20
LOW_WATER = 1 << 16


class TransportError(Exception):
    """A request failed below HTTP semantics."""


class ConnectFailed(TransportError):
    """No connection could be made; nothing was sent."""


class OutOfResources(ConnectFailed):
    """This process ran out of ``resource`` making the connection; nothing was sent."""

    def __init__(self, message: str, resource: str) -> None:
        super().__init__(message)
        self.resource = resource


_RESOURCES = {
    errno.EMFILE: "file_descriptors",
    errno.ENFILE: "file_descriptors",
    errno.ENOBUFS: "socket_buffers",
    errno.ENOMEM: "memory",
}
"""The errors of connect() that are the calling process's own, by what ran out."""


def own_resource(exc: BaseException | None) -> str | None:
    """What ran out, when ``exc`` is this process's own resource error (else None)."""
    if isinstance(exc, OSError):
        return _RESOURCES.get(exc.errno or 0)
    return None


class ReadTimedOut(TransportError):
    """No byte arrived within the read timeout."""


class PoolTimedOut(TransportError):
    """No connection slot freed within the pool timeout."""


class ConnectionBroken(TransportError):
    """The connection closed early or carried something that is not HTTP/1.1."""


@record
class Origin:
    """Where a request goes: scheme, host and port (parsed once per base URL)."""

    scheme: str
    host: str
    port: int

    @classmethod
    def of(cls, url: str) -> Origin:
        parts = urlsplit(url)
        scheme = parts.scheme or "http"
        port = parts.port or (443 if scheme == "https" else 80)
        return cls(scheme, parts.hostname or "", port)

    @property
    def host_header(self) -> bytes:
        default = 443 if self.scheme == "https" else 80
        host = f"[{self.host}]" if ":" in self.host else self.host
        return (host if self.port == default else f"{host}:{self.port}").encode()


@record
class Timeouts:
    """Seconds allowed to connect, between two reads, and to wait for a pool slot."""

    connect: float
    read: float
    pool: float


_JOINED = 65536
"""The body size up to which a request is written in one piece."""


@record
class Request:
    """One request as the transport sends it; ``headers`` are extra header lines."""

    method: str
    origin: Origin
    path: str
    content: bytes | tuple[bytes, ...] = b""
    """The body: one piece, or pieces sent one after the other (never joined, so
    requests that share a large piece do not each copy it)."""
    headers: Sequence[tuple[str, str]] = ()

    @property
    def url(self) -> str:
        return f"{self.origin.scheme}://{self.origin.host_header.decode()}{self.path}"

    def json(self) -> Any:
        content = self.content
        return orjson.loads(content if isinstance(content, bytes) else b"".join(content))

    def header(self, name: str) -> str | None:
        wanted = name.lower()
        for key, value in self.headers:
            if key.lower() == wanted:
                return value
        return None

    def encode(self) -> tuple[bytes, ...]:
        """The request as the pieces to write: one when the body is small, else the
        head and the body's pieces as they are."""
        content = (self.content,) if isinstance(self.content, bytes) else self.content
        size = sum(map(len, content))
        lines = [
            f"{self.method} {self.path} HTTP/1.1\r\n".encode(),
            b"host: " + self.origin.host_header + b"\r\n",
        ]
        if size or self.method == "POST":
            lines.append(b"content-type: application/json\r\ncontent-length: ")
            lines.append(str(size).encode() + b"\r\n")
        lines.extend(f"{key}: {value}\r\n".encode() for key, value in self.headers)
        lines.append(b"\r\n")
        if size <= _JOINED:
            return (b"".join((*lines, *content)),)
        return (b"".join(lines), *content)


class Response(Protocol):
    """An answer whose status and headers arrived; the body is read on demand."""

    status: int
    headers: list[tuple[str, str]]

    def __aiter__(self) -> AsyncIterator[bytes]: ...

    async def read(self) -> bytes: ...

    async def aclose(self) -> None: ...


class Transport(Protocol):
    """What :class:`~pd_orchestrator.upstream.client.Upstream` sends through."""

    async def send(self, request: Request, timeouts: Timeouts) -> Response: ...

    async def aclose(self) -> None: ...


# -- the socket transport ---------------------------------------------------------------------
class _Connection(asyncio.Protocol):
    """One keep-alive connection: the httptools parser fed from the socket.

    A lost connection is in no reference cycle, so it is freed as soon as the pool and
    the response let go of it: the parser (which holds this protocol's callbacks) exists
    only while connected (made with the connection, dropped when it is lost; a connect
    that fails never makes one), and a failure is kept as its reason and raised
    as a fresh :class:`ConnectionBroken` each time (a kept exception would hold, through
    its traceback, the frames of the request that saw it). A pooled connection lives
    long enough for the collector to count it old: were it cyclic garbage when it died,
    it and the request it last served would wait for a full collection, which the
    gateway's collector thresholds make rare (the soak saw its memory grow by the hour).
    """

    _parser: httptools.HttpResponseParser  # while connected
    __deletable__ = ("_parser",)  # compiled by mypyc (setup.py): `del` is declared

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.headers: list[tuple[str, str]] = []
        self._headers_done = False
        self._complete = False
        self._keep_alive = False
        self._seen_bytes = False
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._paused = False
        self._broken: str | None = None
        self._waiter: asyncio.Future[None] | None = None

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it
        self.transport = cast(asyncio.Transport, transport)
        self._parser = httptools.HttpResponseParser(self)

    def data_received(self, data: bytes) -> None:
        self._seen_bytes = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(f"invalid HTTP answer ({exc})")
            return
        if self._buffered > HIGH_WATER and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        del self._parser  # no data follows: the parser<->protocol cycle ends here
        if not self._complete:
            reason = "the connection closed before the answer ended"
            self._fail(reason if exc is None else f"{reason} ({exc})")

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.decode("latin-1").lower(), value.decode("latin-1")))

    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()
        self._headers_done = True

    def on_body(self, body: bytes) -> None:
        self._chunks.append(body)
        self._buffered += len(body)

    def on_message_complete(self) -> None:
        # llhttp resets its flags once the callback returns: ask now, not later
        self._keep_alive = self._parser.should_keep_alive()
        self._complete = True

    # used by the transport and the response
    def _fail(self, reason: str) -> None:
        if self._broken is None:
            self._broken = reason
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _wait(self, seconds: float) -> None:
        waiter = self._waiter = self._loop.create_future()
        timer = self._loop.call_later(seconds, _expire, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None

    def start(self, payload: tuple[bytes, ...]) -> None:
        """Write a request. A transport already closing (the server closed the idle
        connection, and its loss is not delivered yet) is :class:`ConnectionBroken`, so
        the send is made once more on a fresh connection; uvloop raises RuntimeError
        when written to then."""
        self._reset()
        transport = self.transport
        assert transport is not None
        if transport.is_closing():
            raise ConnectionBroken("the connection closed before the answer began")
        try:
            for piece in payload:
                transport.write(piece)
        except RuntimeError as exc:
            raise ConnectionBroken(
                f"the connection closed before the answer began ({exc})"
            ) from exc

    async def head(self, seconds: float) -> None:
        """Wait for the status line and headers (``seconds`` between two reads)."""
        while not self._headers_done:
            if self._broken is not None:
                raise ConnectionBroken(self._broken)
            await self._wait(seconds)

    @property
    def seen_bytes(self) -> bool:
        return self._seen_bytes

    async def next_piece(self, seconds: float) -> bytes | None:
        """The next piece of the body; None at its end."""
        while not self._chunks:
            if self._complete:
                return None
            if self._broken is not None:
                raise ConnectionBroken(self._broken)
            await self._wait(seconds)
        piece = self._chunks.popleft()
        if len(self._chunks) > 1:  # coalesce what is already here into one piece
            piece = b"".join((piece, *self._chunks))
            self._chunks.clear()
        self._buffered = sum(map(len, self._chunks))
        if self._paused and self._buffered < LOW_WATER and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        return piece

    @property
    def reusable(self) -> bool:
        return self._complete and self._keep_alive and not self.closed

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


def _untraced(exc: BaseException) -> None:
    """Drop the tracebacks of ``exc`` and of the exceptions it chains: a failed connect's
    traceback holds ``asyncio.wait_for``'s frame, which holds the future that holds
    ``exc`` -- a cycle that would keep them until a full collection. What is kept of a
    failed connect is its message."""
    seen: BaseException | None = exc
    for _ in range(8):  # a chain is short; bounded all the same
        if seen is None:
            return
        seen.__traceback__ = None
        seen = seen.__cause__ or seen.__context__


def _expire(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(ReadTimedOut("no answer within the read timeout"))


class _SocketResponse:
    """A response read from a pooled connection."""

    def __init__(self, pool: _Pool, connection: _Connection, read_timeout: float) -> None:
        self._pool = pool
        self._connection = connection
        self._timeout = read_timeout
        self._released = False
        self.status = connection.status
        self.headers = connection.headers

    def __aiter__(self) -> _SocketResponse:
        return self

    async def __anext__(self) -> bytes:
        """The body's next piece; at its end the connection goes back to the pool (an
        iterator, not an async generator: no generator for the loop to track per
        answer). Once released it reads nothing more: the connection may be another's."""
        if self._released:
            raise StopAsyncIteration
        piece = await self._connection.next_piece(self._timeout)
        if piece is None:
            await self.aclose()
            raise StopAsyncIteration
        return piece

    async def read(self) -> bytes:
        pieces = [piece async for piece in self]
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)

    async def aclose(self) -> None:
        if self._released:
            return
        self._released = True
        connection = self._connection
        if not connection.reusable:
            connection.close()
        self._pool.release(connection)


class _Pool:
    """Connections to one origin: at most ``limit`` open, up to ``keepalive`` idle."""

    def __init__(self, origin: Origin, limit: int, keepalive: int, expiry: float) -> None:
        self.origin = origin
        self.limit = limit
        self.keepalive = keepalive
        self.expiry = expiry
        self.idle: list[_Connection] = []
        self.active = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._ssl = ssl.create_default_context() if origin.scheme == "https" else None

    async def acquire(self, timeouts: Timeouts) -> tuple[_Connection, bool]:
        """A connection and whether it was reused from the idle list."""
        await self._slot(timeouts.pool)
        now = time.monotonic()
        while self.idle:
            connection = self.idle.pop()
            if not connection.closed and now - connection.idle_since < self.expiry:
                return connection, True
            connection.close()
        try:
            return await self._connect(timeouts.connect), False
        except BaseException:
            self._free_slot()
            raise

    async def _slot(self, seconds: float) -> None:
        if self.active < self.limit and not self._waiters:
            self.active += 1
            return
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()
        self._waiters.append(waiter)
        timer = loop.call_later(seconds, _pool_expire, waiter)
        try:
            await waiter
        except BaseException:
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                self._free_slot()  # the slot was handed over as we gave up
            raise
        finally:
            timer.cancel()
            if waiter in self._waiters:
                self._waiters.remove(waiter)

    def _free_slot(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot passes to the waiter
                return
        self.active -= 1

    async def _connect(self, seconds: float) -> _Connection:
        loop = asyncio.get_running_loop()
        origin = self.origin
        try:
            _, connection = await asyncio.wait_for(
                loop.create_connection(
                    lambda: _Connection(loop),
                    origin.host,
                    origin.port,
                    ssl=self._ssl,
                    server_hostname=origin.host if self._ssl else None,
                ),
                seconds,
            )
        except TimeoutError as exc:
            _untraced(exc)
            raise ConnectFailed(f"connect timed out after {seconds:g} s") from exc
        except OSError as exc:
            _untraced(exc)
            message = exc.strerror or type(exc).__name__
            resource = own_resource(exc)
            if resource is not None:
                raise OutOfResources(message, resource) from exc
            raise ConnectFailed(message) from exc
        return connection

    def release(self, connection: _Connection) -> None:
        if not connection.closed and len(self.idle) < self.keepalive:
            connection.idle_since = time.monotonic()
            self.idle.append(connection)
        else:
            connection.close()
        self._free_slot()

    def discard(self, connection: _Connection) -> None:
        connection.close()
        self._free_slot()

    def close(self) -> None:
        for connection in self.idle:
            connection.close()
        self.idle.clear()


def _pool_expire(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(PoolTimedOut("no upstream connection became free in time"))


_MAX_POOLS = 512
"""Origins pooled at once before the idle pools are forgotten (:meth:`HttpTransport._prune`)."""


class HttpTransport:
    """HTTP/1.1 over TCP (or TLS for https origins), pooled per origin."""

    def __init__(
        self, *, max_connections: int = 1024, max_keepalive: int = 256, expiry: float = 4.0
    ) -> None:
        self._limit = max_connections
        self._keepalive = max_keepalive
        self._expiry = expiry
        self._pools: dict[Origin, _Pool] = {}

    def _pool(self, origin: Origin) -> _Pool:
        pool = self._pools.get(origin)
        if pool is None:
            if len(self._pools) >= _MAX_POOLS:
                self._prune()
            pool = self._pools[origin] = _Pool(origin, self._limit, self._keepalive, self._expiry)
        return pool

    def _prune(self) -> None:
        """Forget the pools with no connection in use (their idle ones are closed): the
        origins a sidecar's headers name come and go, and no client can grow this map
        without bound."""
        for origin, pool in list(self._pools.items()):
            if not pool.active and not pool._waiters:
                pool.close()
                del self._pools[origin]

    async def send(self, request: Request, timeouts: Timeouts) -> Response:
        """Send ``request``; return when the answer's headers arrived (see the module doc)."""
        pool = self._pool(request.origin)
        payload = request.encode()
        for _ in range(2):
            connection, reused = await pool.acquire(timeouts)
            try:
                connection.start(payload)
                await connection.head(timeouts.read)
            except ConnectionBroken:
                pool.discard(connection)
                if reused and not connection.seen_bytes:
                    continue  # the server closed the idle connection: once more, fresh
                raise
            except BaseException:
                pool.discard(connection)
                raise
            return _SocketResponse(pool, connection, timeouts.read)
        raise ConnectionBroken("the connection closed before the answer began")

    async def aclose(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
