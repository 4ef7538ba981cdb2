"""The HTTP/1.1 protocol the gateway serves on: a connection parsed by httptools
(llhttp), each request handed to the ASGI application, with limits on the request
head, on how long a connection may hold the gateway, and on how many connections
are open, and its own refusals in the OpenAI error shape.

uvicorn runs the server (its sockets, lifespan, signals and shutdown) and calls
:func:`limited_protocol`'s :class:`Listener` for each connection. The protocol is
the gateway's own, not uvicorn's httptools protocol: it does per request and per
chunk only what the gateway needs (docs/performance.md, "Thirteenth pass"), and it
is compiled with the request path. What it does as uvicorn's protocol did: ASGI 3
``http`` scopes (``method``, ``path`` percent-decoded, ``raw_path``,
``query_string``, ``headers`` with lower-cased names, ``client``, ``server``,
``scheme``, ``root_path``, ``state``); keep-alive for HTTP/1.1 unless the client or
the answer says ``close``, none for HTTP/1.0; pipelined requests answered in order,
one at a time, reading paused while one waits; ``Expect: 100-continue`` answered
when the application first reads the body; request bodies of any framing (llhttp
takes chunked ones apart), reading paused past 64 KiB unread; answers framed by
their ``content-length``, or chunked when they give none (none for ``HEAD``, 204 and
304), with the server's ``date`` header; header names and values an application
sends checked for bytes that would split the head; writes paused while the
client's socket buffer is full (an ASGI ``send`` waits); an ``Upgrade`` request
served as plain HTTP and its connection closed after the answer (the gateway speaks
no WebSocket); a 500 when the application fails before it answered, the connection
closed when it fails after.

The limits. Without them a server keeps whatever head a client sends (llhttp has no
limit: a 50 MB header value is buffered whole before the application sees it),
waits for a head or a body as long as the client likes, and takes every connection
until the process runs out of file descriptors. The protocol:

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
* closes a connection idle between requests after ``limits.keepalive_timeout``;
* holds at most ``limits.max_connections`` connections (default: half the
  process's open-file limit), and at most ``limits.max_connection_share`` of them
  from one peer address: a connection past either first closes the longest idle
  connection in its way (one waiting for its first request or idle between two, the
  peer's own when the peer is at its share), as nginx and Envoy do, so holding the
  cap costs a client a request in flight on every connection; with nothing idle to
  close it is answered 503 at once and closed;
* on the probe port (``listen.probe_port``, when the gateway serves one) answers
  only ``/health``, ``/ready`` and ``/metrics`` (404 otherwise), on connections
  counted apart (:data:`PROBE_CONNECTIONS` of them), so the probes stay answerable
  however many connections clients hold on the main port.

The head timer of a pipelined request (one sent while the answer before it is
still under way) starts when that answer has ended: such a request is read only
then, and its timer must not close the connection under the answer in front of it.

Each refusal closes the connection. A request the parser cannot read is answered
400 (or, when an answer is under way on the connection, the connection is closed).
Every answer is ``{"error": {"message", "type", "param", "code"}}``. The limits are
read when a connection opens and at the start of each request, so a reload applies
them to the next one.

What the protocol writes in one turn of the event loop leaves in one write
(:class:`CorkedTransport`): a whole answer's head and body, a stream's head and
first events, go out in one system call instead of one each (two socket writes per
relayed request, one upstream and one to the client: the least there can be).

The timeouts share one timer per connection, armed lazily: a request moves a
deadline (a float), and the timer, when it fires early, re-arms itself for the
deadline it finds -- no timer is created or cancelled per request. A timer that
finds its wait over closes the connection only after one more read of its socket
(:data:`LAST_LOOK`): an event loop held up for longer than a timeout runs its due
timers before it reads, and a request a client sent in time would otherwise be cut
by a reset.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import resource
import urllib.parse
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping
from http import HTTPStatus
from typing import Any, Final, Literal

import httptools
import orjson

from pd_orchestrator.config.settings import LimitsConfig
from pd_orchestrator.openai.errors import error_body
from pd_orchestrator.upstream.transport import own_resource

__all__ = [
    "CORK_BYTES",
    "DISCONNECTS",
    "PROBE_CONNECTIONS",
    "PROBE_PATHS",
    "TOO_MANY_CONNECTIONS",
    "TOO_MANY_FROM_PEER",
    "CorkedTransport",
    "Disconnects",
    "Exchange",
    "HttpConnection",
    "Listener",
    "count_accept_errors",
    "default_concurrent_choices",
    "default_max_connections",
    "error_bytes",
    "limited_protocol",
]

TOO_MANY_CONNECTIONS = "the gateway has too many connections open; try again"
TOO_MANY_FROM_PEER = "this client has too many connections open to the gateway; try again"
PROBE_PATHS = frozenset({b"/health", b"/ready", b"/metrics"})
"""What the probe port answers."""
PROBE_CONNECTIONS = 64
"""Connections the probe port holds at once (apart from the main port's cap)."""
LAST_LOOK = 0.001
"""Seconds a timed-out connection is kept for one more read of its socket before it is
closed: an event loop that was held up runs its due timers before it reads what
arrived meanwhile (uvloop's does), and would close a connection over a request sent
in time."""
_Waiting = Literal["request", "head", "body", "idle"]
"""What a connection's deadline waits for: a first request (nothing sent yet), the
rest of a head, the rest of a body, the next request (idle between two)."""


CORK_BYTES = 1 << 16
"""Bytes held for one write at most: more are written at once."""


class CorkedTransport:
    """A transport whose writes within one turn of the event loop go out as one.

    :meth:`write` holds the bytes and, once per turn, schedules a flush for the end
    of it (``call_soon``); holding :data:`CORK_BYTES` or more flushes at once, and
    :meth:`close` flushes first, so nothing written is lost or reordered and nothing
    waits longer than the callbacks already due. Bytes written while the transport
    is closing are dropped, as the transport drops them. Reading, closing and the
    extra information are the wrapped transport's.
    """

    __slots__ = ("_held", "_loop", "_size", "transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self.transport = transport
        self._loop = loop
        self._held: list[bytes] = []
        self._size = 0

    def write(self, data: bytes | bytearray | memoryview) -> None:
        held = self._held
        if not held:
            self._loop.call_soon(self.flush)
        held.append(bytes(data))
        self._size += len(data)
        if self._size >= CORK_BYTES:
            self.flush()

    def flush(self) -> None:
        """Write what is held (nothing when the transport is closing)."""
        held = self._held
        if not held:
            return
        data = held[0] if len(held) == 1 else b"".join(held)
        held.clear()
        self._size = 0
        if not self.transport.is_closing():
            self.transport.write(data)

    def close(self) -> None:
        self.flush()
        self.transport.close()

    def is_closing(self) -> bool:
        return self.transport.is_closing()

    def pause_reading(self) -> None:
        self.transport.pause_reading()

    def resume_reading(self) -> None:
        self.transport.resume_reading()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self.transport.get_extra_info(name, default)

    def get_write_buffer_size(self) -> int:
        return self.transport.get_write_buffer_size()


DISCONNECTS = "pd_orchestrator.disconnects"
"""The ASGI scope extension under which the protocol offers each request its
connection's :class:`Disconnects` (``scope["extensions"][DISCONNECTS]["connection"]``;
the extension dict is the connection's, the same for each of its requests)."""


class Disconnects:
    """The callbacks to call when a connection is lost: an answer on it watches for
    its client's going without a task of its own waiting on ``receive()``.

    :meth:`add` a callback while the answer runs, :meth:`discard` it after; the
    protocol calls :meth:`lost` from ``connection_lost``, which calls every callback
    still added, once each, and none added after.
    """

    __slots__ = ("_callbacks", "gone")

    def __init__(self) -> None:
        self._callbacks: list[Callable[[], None]] = []
        self.gone = False

    def add(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` when the connection is lost (at once if it was)."""
        if self.gone:
            callback()
        else:
            self._callbacks.append(callback)

    def discard(self, callback: Callable[[], None]) -> None:
        """Forget ``callback`` (nothing when it was not added or already called)."""
        try:
            self._callbacks.remove(callback)
        except ValueError:
            pass

    def lost(self) -> None:
        """The connection is gone: call every callback added (once)."""
        self.gone = True
        callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()


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


class _Held:
    """The connections one listener kind holds: how many, how many per peer address,
    and the idle ones, longest idle first (an insertion-ordered dict)."""

    def __init__(self) -> None:
        self.count = 0
        self.peers: Counter[str] = Counter()
        self.idle: dict[Any, None] = {}

    def admit(self, peer: str, cap: int, share: int) -> str | None:
        """Count a new connection from ``peer`` in, closing an idle one in its way
        (``share``: the most one peer may hold); None, or why not."""
        if self.peers[peer] >= share and not self._evict(peer):
            return TOO_MANY_FROM_PEER
        if self.count >= cap and not self._evict(None):
            return TOO_MANY_CONNECTIONS
        self.count += 1
        self.peers[peer] += 1
        return None

    def release(self, peer: str) -> None:
        self.count -= 1
        self.peers[peer] -= 1
        if not self.peers[peer]:
            del self.peers[peer]

    def _evict(self, peer: str | None) -> bool:
        """Close the longest idle connection (of ``peer``, when given); whether one was."""
        for connection in self.idle:
            if peer is None or connection.peer == peer:
                connection.evict()
                return True
        return False


def count_accept_errors(loop: asyncio.AbstractEventLoop, count: Callable[[str], None]) -> None:
    """Make ``loop`` call ``count(resource)`` for each error it reports that is the
    process's own (an ``accept()`` that ran out of descriptors: the event loop stops
    accepting for a moment and reports it), then handle it as before."""
    previous = loop.get_exception_handler()

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        resource = own_resource(context.get("exception"))
        if resource is not None:
            count(resource)
        if previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handler)


def default_concurrent_choices() -> int:
    """``limits.max_concurrent_choices`` when unset: one per 64 of the process's open
    files, at least 4 and at most 32 (a choice holds one or two upstream connections;
    the connection cap leaves half the files to the upstream side)."""
    return min(32, max(4, default_max_connections() // 32))


# -- the protocol ---------------------------------------------------------------------------------
logger = logging.getLogger("uvicorn.error")  # where uvicorn's own protocol logged the same

HIGH_WATER: Final = 65536
"""Bytes of request body held unread before reading from the socket pauses."""
_BAD_NAME: Final = re.compile(b'[\x00-\x1f\x7f()<>@,;:\\[\\]={} \t\\\\"]')
_BAD_VALUE: Final = re.compile(b"[\x00-\x08\x0a-\x1f\x7f]")
_CONTINUE: Final = b"HTTP/1.1 100 Continue\r\n\r\n"
_NOT_HTTP: Final = "the request is not valid HTTP/1.1"


def _status_line(status: int) -> bytes:
    try:
        phrase = HTTPStatus(status).phrase.encode()
    except ValueError:
        phrase = b""
    return b"HTTP/1.1 %d %s\r\n" % (status, phrase)


_STATUS_LINES: Final = {status: _status_line(status) for status in range(100, 600)}


def _address(info: object) -> tuple[str, int] | None:
    """A socket address as ASGI's ``client`` and ``server`` give it (None for a Unix
    socket's path)."""
    if isinstance(info, tuple) and len(info) >= 2:
        return str(info[0]), int(info[1])
    return None


def _target(url: bytes, root_path: str) -> tuple[str, bytes, bytes]:
    """``path`` (percent-decoded), ``raw_path`` and ``query_string`` of a request
    target; an absolute or odd one is read by httptools (which refuses what is no URL)."""
    if url[:1] == b"/" and b"#" not in url:
        raw, _, query = url.partition(b"?")
    else:
        parsed = httptools.parse_url(url)
        raw, query = parsed.path or b"", parsed.query or b""
    path = raw.decode("ascii")
    if "%" in path:
        path = urllib.parse.unquote(path)
    if root_path:
        return root_path + path, root_path.encode("ascii") + raw, query
    return path, raw, query


class Listener:
    """What the connections of one server share: the limits (``limits()``, read
    anew at each connection and request), the probe port, the connections each port
    holds. uvicorn calls it, as it would a protocol class, for each new connection."""

    def __init__(self, limits: Callable[[], LimitsConfig], probe_port: int | None) -> None:
        self.limits = limits
        self.probe_port = probe_port
        self.default_cap = default_max_connections()
        self.main = _Held()
        self.probes = _Held()
        self._defaults_of: list[tuple[bytes, bytes]] | None = None
        self._defaults = b""

    def __call__(
        self,
        config: Any,
        server_state: Any,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> HttpConnection:
        return HttpConnection(self, config, server_state, app_state, _loop)

    def defaults(self, current: list[tuple[bytes, bytes]]) -> bytes:
        """The server's default headers (``date``, which uvicorn renews each second)
        as head lines, encoded once per renewal."""
        if current is not self._defaults_of:
            self._defaults_of = current
            self._defaults = b"".join(name + b": " + value + b"\r\n" for name, value in current)
        return self._defaults


class Exchange:
    """One request on a connection and its answer: the ASGI ``receive`` and
    ``send`` of the application's call."""

    def __init__(
        self,
        connection: HttpConnection,
        scope: dict[str, Any],
        keep_alive: bool,
        head_only: bool,
        expect_100: bool,
    ) -> None:
        self.connection = connection
        self.scope = scope
        self.keep_alive = keep_alive
        self.head_only = head_only
        self.expect_100 = expect_100
        self.body = bytearray()
        self.more_body = True
        self.ready = False  # body, its end, or the answer's end came since the last receive
        self.waiter: asyncio.Future[None] | None = None
        self.started = False
        self.complete = False
        self.disconnected = False
        self.chunked = False
        self.framed = False  # content-length or chunked chosen
        self.length_left = 0

    def wake(self) -> None:
        """Something for :meth:`receive` to tell: let it go on."""
        self.ready = True
        waiter = self.waiter
        if waiter is not None:
            self.waiter = None
            if not waiter.done():
                waiter.set_result(None)

    async def receive(self) -> dict[str, Any]:
        """ASGI ``receive``: the body read so far (``http.request``), else, once the
        answer has ended or the client has gone, ``http.disconnect``."""
        connection = self.connection
        if self.expect_100:
            self.expect_100 = False
            if not connection.transport.is_closing():
                connection.transport.write(_CONTINUE)
        if not self.disconnected and not self.complete:
            connection.resume_reading()
            if not self.ready:
                waiter = connection.loop.create_future()
                self.waiter = waiter
                await waiter
            self.ready = False
        if self.disconnected or self.complete:
            return {"type": "http.disconnect"}
        body = bytes(self.body)
        self.body = bytearray()
        return {"type": "http.request", "body": body, "more_body": self.more_body}

    async def send(self, message: Mapping[str, Any]) -> None:
        """ASGI ``send``: the answer's head, then its body; waits while the client's
        socket buffer is full; nothing once the client has gone."""
        connection = self.connection
        if connection.write_paused and not self.disconnected:
            await connection.drain()
        if self.disconnected:
            return
        kind = message["type"]
        if not self.started:
            if kind != "http.response.start":
                raise RuntimeError(f"expected 'http.response.start', got {kind!r}")
            head = self._head(message["status"], message.get("headers", ()))
            self.started = True  # a head refused above leaves the 500 to the protocol
            self.expect_100 = False
            connection.transport.write(head)
        elif not self.complete:
            if kind != "http.response.body":
                raise RuntimeError(f"expected 'http.response.body', got {kind!r}")
            self._body(message.get("body", b""), bool(message.get("more_body", False)))
        else:
            raise RuntimeError(f"unexpected {kind!r} after the answer ended")

    def _head(self, status: int, headers: Iterable[Any]) -> bytes:
        connection = self.connection
        lines = [_STATUS_LINES.get(status) or _status_line(status)]
        lines.append(connection.listener.defaults(connection.server_state.default_headers))
        names: list[bytes] = []
        values: list[bytes] = []
        says_close = False
        for name, value in headers:
            name = name.lower()
            if name == b"content-length" and not self.framed:
                self.length_left = int(value.decode())
                self.framed = True
            elif name == b"transfer-encoding" and value.lower() == b"chunked":
                self.length_left = 0
                self.framed = self.chunked = True
            elif name == b"connection" and b"close" in _tokens(value):
                self.keep_alive = False
                says_close = True
            names.append(name)
            values.append(value)
            lines.append(name + b": " + value + b"\r\n")
        # One search each over all names and all values: a byte that would split the head
        if _BAD_NAME.search(b"".join(names)) is not None:
            raise RuntimeError("invalid HTTP header name")
        if _BAD_VALUE.search(b"".join(values)) is not None:
            raise RuntimeError("invalid HTTP header value")
        if not self.keep_alive and not says_close:
            lines.append(b"connection: close\r\n")
        if not self.framed and not self.head_only and status not in (204, 304):
            self.framed = self.chunked = True
            lines.append(b"transfer-encoding: chunked\r\n")
        lines.append(b"\r\n")
        return b"".join(lines)

    def _body(self, body: bytes | bytearray | memoryview, more: bool) -> None:
        transport = self.connection.transport
        if self.head_only:
            self.length_left = 0
        elif self.chunked:
            if body:
                transport.write(b"".join((b"%x\r\n" % len(body), body, b"\r\n")))
            if not more:
                transport.write(b"0\r\n\r\n")
        else:
            if len(body) > self.length_left:
                raise RuntimeError("the answer is longer than its content-length")
            self.length_left -= len(body)
            if body:
                transport.write(body)
        if more:
            return
        if self.length_left != 0:
            raise RuntimeError("the answer is shorter than its content-length")
        self.complete = True
        self.wake()
        if not self.keep_alive:
            transport.close()
        self.connection.answered()


def _tokens(value: bytes) -> list[bytes]:
    return [token.strip().lower() for token in value.split(b",")]


class HttpConnection:
    """One client connection (an asyncio protocol): parses requests as bytes
    arrive, runs the application on each, enforces the limits (module docstring)."""

    transport: CorkedTransport

    def __init__(
        self,
        listener: Listener,
        config: Any,
        server_state: Any,
        app_state: dict[str, Any],
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        if not config.loaded:
            config.load()
        self.listener = listener
        self.app: Callable[..., Any] = config.loaded_app
        self.root_path: str = config.root_path
        self.loop = loop or asyncio.get_event_loop()
        self.server_state = server_state
        self.app_state = app_state
        parser = httptools.HttpRequestParser(self)
        parser.set_dangerous_leniencies(lenient_data_after_close=True)  # answer, then close
        self.parser: httptools.HttpRequestParser | None = parser
        self.server: tuple[str, int] | None = None
        self.client: tuple[str, int] | None = None
        self.scheme = "http"
        self.peer = ""
        self.held: _Held | None = None
        self.limits = listener.limits()
        self.deferred: tuple[_Waiting, float] | None = None
        self.in_head = True
        self.unparsed = 0
        self.head_bytes = 0
        self.head_count = 0
        self.refusal: tuple[int, str] | None = None
        self.waiting: _Waiting = "request"
        self.deadline: float | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.disconnects = Disconnects()
        self.extensions: dict[str, dict[object, object]] = {
            DISCONNECTS: {"connection": self.disconnects}
        }
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.expect_100 = False
        self.exchange: Exchange | None = None  # the newest request (its body arrives)
        self.running: Exchange | None = None  # the one the application answers
        self.pipeline: deque[Exchange] = deque()
        self.read_paused = False
        self.write_paused = False
        self.drained: asyncio.Future[None] | None = None

    # -- asyncio's protocol ------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:
        self.server_state.connections.add(self)
        self.transport = CorkedTransport(transport, self.loop)
        self.server = _address(transport.get_extra_info("sockname"))
        self.client = _address(transport.get_extra_info("peername"))
        if transport.get_extra_info("sslcontext"):
            self.scheme = "https"
        self.peer = self.client[0] if self.client else ""
        listener, limits = self.listener, self.limits
        server, port = self.server, listener.probe_port
        probe = port is not None and server is not None and server[1] == port
        held = listener.probes if probe else listener.main
        cap = PROBE_CONNECTIONS if probe else (limits.max_connections or listener.default_cap)
        share = PROBE_CONNECTIONS if probe else max(1, math.ceil(cap * limits.max_connection_share))
        refused = held.admit(self.peer, cap, share)
        if refused is not None:
            self._refuse(503, refused)
            return
        self.held = held
        held.idle[self] = None
        self._expect("request", limits.header_timeout)

    def connection_lost(self, exc: Exception | None) -> None:
        self.server_state.connections.discard(self)
        self.deadline = None
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self._let_go()
        for exchange in (self.running, self.exchange):
            if exchange is not None:
                if not exchange.complete:
                    exchange.disconnected = True
                exchange.wake()
        self.resume_writing()
        if exc is None:
            self.transport.close()
        self.parser = None
        self.exchange = self.running = None  # no cycle kept through the exchanges
        self.pipeline.clear()
        self.disconnects.lost()

    def eof_received(self) -> bool | None:
        return None

    def data_received(self, data: bytes) -> None:
        held = self.held
        if held is not None:
            held.idle.pop(self, None)
        if self.in_head:
            self.unparsed += len(data)
        parser = self.parser
        if parser is None:
            return
        try:
            parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            exchange = self.exchange  # served as plain HTTP; nothing more is read
            if exchange is not None:
                exchange.keep_alive = False
        except httptools.HttpParserError:
            running = self.running
            if running is not None and running.started and not running.complete:
                self.transport.close()  # no refusal in the middle of an answer
            else:
                self._refuse(*(self.refusal or (400, _NOT_HTTP)))
            return
        limit = self.limits.max_header_bytes
        if self.in_head and self.unparsed > 2 * limit and not self.transport.is_closing():
            self._refuse(431, f"the request head exceeds {limit} bytes")

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        drained, self.drained = self.drained, None
        if drained is not None and not drained.done():
            drained.set_result(None)

    async def drain(self) -> None:
        """Wait until the client's socket buffer has room again (or it is gone)."""
        if self.write_paused:
            drained = self.drained
            if drained is None or drained.done():  # one a cancelled sender left is no use
                drained = self.drained = self.loop.create_future()
            await drained

    def resume_reading(self) -> None:
        if self.read_paused:
            self.read_paused = False
            if not self.transport.is_closing():
                self.transport.resume_reading()

    def pause_reading(self) -> None:
        if not self.read_paused:
            self.read_paused = True
            if not self.transport.is_closing():
                self.transport.pause_reading()

    # -- httptools' callbacks ----------------------------------------------------------
    def on_message_begin(self) -> None:
        self.url = b""
        self.headers = []
        self.expect_100 = False
        self.limits = limits = self.listener.limits()
        self.head_bytes = self.head_count = 0
        self.refusal = None
        if self._answering():  # pipelined: its time starts when the answer ended
            self.deferred = ("head", limits.header_timeout)
        elif self.deadline is None or self.waiting == "idle":  # a later request: from now
            self._expect("head", limits.header_timeout)
        self.waiting = "head"

    def on_url(self, url: bytes) -> None:
        self._count(len(url), 0)
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count(len(name) + len(value), 1)
        name = name.lower()
        if name == b"expect" and value.lower() == b"100-continue":
            self.expect_100 = True
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.in_head = False
        url = self.url
        if self.held is self.listener.probes and url.partition(b"?")[0] not in PROBE_PATHS:
            self.refusal = (404, "the probe port answers /health, /ready and /metrics")
            raise _HeadRefused
        pipelined = self._answering()
        parser = self.parser
        assert parser is not None  # a callback of its own
        version = parser.get_http_version()
        method = parser.get_method().decode("ascii")
        path, raw_path, query = _target(url, self.root_path)
        scope: dict[str, Any] = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": version,
            "server": self.server,
            "client": self.client,
            "scheme": self.scheme,
            "root_path": self.root_path,
            "headers": self.headers,
            "state": self.app_state.copy(),
            "method": method,
            "path": path,
            "raw_path": raw_path,
            "query_string": query,
            "extensions": self.extensions,
        }
        keep_alive = version != "1.0" and parser.should_keep_alive()
        exchange = Exchange(self, scope, keep_alive, method == "HEAD", self.expect_100)
        self.exchange = exchange
        if pipelined:  # answered once the one in front has been
            self.pause_reading()
            self.pipeline.append(exchange)
            self.deferred = ("body", self.limits.body_timeout)
        else:
            self._start(exchange)
            self._expect("body", self.limits.body_timeout)

    def on_body(self, body: bytes) -> None:
        exchange = self.exchange
        if exchange is None or exchange.complete:
            return
        exchange.body += body
        if len(exchange.body) > HIGH_WATER:
            self.pause_reading()
        exchange.wake()

    def on_message_complete(self) -> None:
        self.in_head = True
        self.unparsed = 0
        self.deadline = None
        self.deferred = None
        exchange = self.exchange
        if exchange is None or exchange.complete:
            return
        exchange.more_body = False
        exchange.wake()

    # -- the application ---------------------------------------------------------------
    def _start(self, exchange: Exchange) -> None:
        self.running = exchange
        task = self.loop.create_task(self._run(exchange))
        tasks = self.server_state.tasks
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    async def _run(self, exchange: Exchange) -> None:
        try:
            await self.app(exchange.scope, exchange.receive, exchange.send)
        except BaseException as exc:  # the server's last word on a failed application
            logger.error("Exception in ASGI application", exc_info=exc)
            self._failed(exchange)
            return
        if not exchange.disconnected and not exchange.complete:
            logger.error("the ASGI application returned without completing its answer")
            self._failed(exchange)

    def _failed(self, exchange: Exchange) -> None:
        if not exchange.started and not self.transport.is_closing():
            exchange.started = exchange.complete = True
            self._refuse(500, "the gateway failed to answer the request")
        else:
            self.transport.close()

    def answered(self) -> None:
        """The running request's answer has ended: start the next one, or wait for it."""
        self.server_state.total_requests += 1
        if self.transport.is_closing():
            return
        self.resume_reading()
        deferred, self.deferred = self.deferred, None
        pipelined = bool(self.pipeline)
        if pipelined:
            self._start(self.pipeline.popleft())
        if deferred is not None:  # a request is half in: its own time starts now
            self._expect(*deferred)
        elif not pipelined:
            self._expect("idle", self.limits.keepalive_timeout)
            if self.held is not None:
                self.held.idle[self] = None  # idle until its next byte

    def shutdown(self) -> None:
        """The server is shutting down: close now when idle, else after the answer."""
        running = self.running
        if running is None or running.complete:
            self.transport.close()
        else:
            running.keep_alive = False

    def evict(self) -> None:
        """Close this idle connection to make room for a new one."""
        self._let_go()
        self.transport.close()

    # -- limits ------------------------------------------------------------------------
    def _let_go(self) -> None:
        held, self.held = self.held, None
        if held is not None:
            held.idle.pop(self, None)
            held.release(self.peer)

    def _answering(self) -> bool:
        """An answer is under way on this connection (a request now is pipelined)."""
        exchange = self.exchange
        return exchange is not None and not exchange.complete

    def _count(self, size: int, headers: int) -> None:
        self.head_bytes += size
        self.head_count += headers
        limits = self.limits
        if self.head_count > limits.max_headers:
            self.refusal = (431, f"the request has more than {limits.max_headers} headers")
        elif self.head_bytes > limits.max_header_bytes:
            self.refusal = (431, f"the request head exceeds {limits.max_header_bytes} bytes")
        if self.refusal is not None:
            raise _HeadRefused  # the parser stops; data_received answers

    def _expect(self, waiting: _Waiting, seconds: float) -> None:
        """Give what the connection waits for ``seconds`` from now."""
        self.waiting = waiting
        self.deadline = deadline = self.loop.time() + seconds
        if self.timer is None:
            self.timer = self.loop.call_at(deadline, self._check, False)

    def _check(self, last: bool) -> None:
        """The timer: re-armed for a deadline that moved; past it, one last look
        (:data:`LAST_LOOK`) for bytes that arrived while the loop was held up, then
        the wait timed out."""
        self.timer = None
        deadline = self.deadline
        if deadline is None or self.transport.is_closing():
            return
        if self.loop.time() < deadline:
            self.timer = self.loop.call_at(deadline, self._check, False)
        elif not last:
            self.timer = self.loop.call_later(LAST_LOOK, self._check, True)
        else:
            self._timed_out()

    def _timed_out(self) -> None:
        """408 for a request begun and not answered yet; otherwise close quietly
        (nothing was sent, the connection was idle, or an answer is under way)."""
        exchange, limits = self.exchange, self.limits
        if self.waiting == "head" and (exchange is None or exchange.complete):
            self._refuse(408, f"the request head took more than {limits.header_timeout:g} s")
        elif self.waiting == "body" and exchange is not None and not exchange.started:
            exchange.disconnected = True  # the application's receive() tells it; sends drop
            exchange.wake()
            self._refuse(408, f"the request body took more than {limits.body_timeout:g} s")
        else:
            self.transport.close()

    def _refuse(self, status: int, message: str) -> None:
        self.transport.write(error_bytes(status, message))
        self.transport.close()


def limited_protocol(limits: Callable[[], LimitsConfig], probe_port: int | None = None) -> Listener:
    """What uvicorn calls for each connection (its ``http`` protocol): the gateway's
    protocol, enforcing the limits ``limits()`` gives; connections to local port
    ``probe_port`` are the probe port's."""
    return Listener(limits, probe_port)
