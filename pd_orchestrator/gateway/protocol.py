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
still under way) starts when that answer has ended: uvicorn reads such a request
only then, and its timer must not close the connection under the answer in front
of it.

Each refusal closes the connection. A request the parser cannot read is answered
400 (uvicorn's plain-text answer, rewritten). Every answer is
``{"error": {"message", "type", "param", "code"}}``. The limits are read when a
connection opens and at the start of each request, so a reload applies them to the
next one.

What the protocol writes in one turn of the event loop leaves in one write
(:class:`CorkedTransport`): a whole answer's head and body, a stream's head and
first events, go out in one system call instead of one each (two socket writes per
relayed request, one upstream and one to the client: the least there can be).

The two timeouts share one timer per connection, armed lazily: a request moves a
deadline (a float), and the timer, when it fires early, re-arms itself for the
deadline it finds -- no timer is created or cancelled per request. A timer that
finds its wait over, and uvicorn's keep-alive timer, close the connection only after
one more read of its socket (:data:`LAST_LOOK`): an event loop held up for longer than
a timeout runs its due timers before it reads, and a request a client sent in time
would otherwise be cut by a reset.
"""

from __future__ import annotations

import asyncio
import math
import resource
from collections import Counter
from collections.abc import Callable
from http import HTTPStatus
from typing import Any, Literal

import orjson
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

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
_Waiting = Literal["request", "head", "body"]
"""What a connection's deadline waits for: a first request (nothing sent yet), the
rest of a head, the rest of a body."""


CORK_BYTES = 1 << 16
"""Bytes held for one write at most: more are written at once."""


class CorkedTransport:
    """A transport whose writes within one turn of the event loop go out as one.

    :meth:`write` holds the bytes and, once per turn, schedules a flush for the end
    of it (``call_soon``); holding :data:`CORK_BYTES` or more flushes at once, and
    :meth:`close` flushes first, so nothing written is lost or reordered and nothing
    waits longer than the callbacks already due. Bytes written while the transport
    is closing are dropped, as the transport drops them. Everything else is the
    wrapped transport's.
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

    def __getattr__(self, name: str) -> Any:
        return getattr(self.transport, name)


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


def limited_protocol(
    limits: Callable[[], LimitsConfig], probe_port: int | None = None
) -> type[asyncio.Protocol]:
    """An httptools protocol class that enforces the limits ``limits()`` gives;
    connections to local port ``probe_port`` are the probe port's."""
    default_cap = default_max_connections()
    main, probes = _Held(), _Held()

    class LimitedHttpToolsProtocol(HttpToolsProtocol):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.peer = ""
            self._held: _Held | None = None
            self._deferred: tuple[_Waiting, float] | None = None
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
            self._disconnects = Disconnects()
            self._extensions: dict[str, dict[object, object]] = {
                DISCONNECTS: {"connection": self._disconnects}
            }

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            corked = CorkedTransport(transport, self.loop)
            super().connection_made(corked)  # type: ignore[arg-type]
            self.peer = str(self.client[0]) if self.client else ""
            probe = probe_port is not None and self.server is not None
            probe = probe and self.server[1] == probe_port  # type: ignore[index]
            held = probes if probe else main
            cap = PROBE_CONNECTIONS if probe else (self._limits.max_connections or default_cap)
            share = PROBE_CONNECTIONS if probe else self._limits.max_connection_share
            refused = held.admit(self.peer, cap, max(1, math.ceil(cap * share)))
            if refused is not None:
                self._refuse(503, refused)
                return
            self._held = held
            held.idle[self] = None
            self._expect("request", self._limits.header_timeout)

        def connection_lost(self, exc: Exception | None) -> None:
            self._deadline = None
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            self._let_go()
            super().connection_lost(exc)
            self._disconnects.lost()

        def evict(self) -> None:
            """Close this idle connection to make room for a new one."""
            self._let_go()
            self.transport.close()

        def _let_go(self) -> None:
            held, self._held = self._held, None
            if held is not None:
                held.idle.pop(self, None)
                held.release(self.peer)

        def data_received(self, data: bytes) -> None:
            held = self._held
            if held is not None:
                held.idle.pop(self, None)
            if self._in_head:
                self._unparsed += len(data)
            super().data_received(data)
            limit = self._limits.max_header_bytes
            if self._in_head and self._unparsed > 2 * limit and not self.transport.is_closing():
                self._refuse(431, f"the request head exceeds {limit} bytes")

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self.scope["extensions"] = self._extensions
            self._limits = limits()
            self._head_bytes = self._head_count = 0
            self._refusal = None
            if self._answering():  # pipelined: its time starts when the answer ended
                self._deferred = ("head", self._limits.header_timeout)
            elif self._deadline is None:  # a later request: its head's time starts now
                self._expect("head", self._limits.header_timeout)
            self._waiting = "head"

        def on_url(self, url: bytes) -> None:
            self._count(len(url), 0)
            if self._held is probes and url.split(b"?", 1)[0] not in PROBE_PATHS:
                self._refusal = (404, "the probe port answers /health, /ready and /metrics")
                raise _HeadRefused
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._count(len(name) + len(value), 1)
            super().on_header(name, value)

        def on_headers_complete(self) -> None:
            self._in_head = False
            pipelined = self._answering()
            super().on_headers_complete()
            if pipelined:  # uvicorn reads its body once the answer before it ended
                self._deferred = ("body", self._limits.body_timeout)
            else:
                self._expect("body", self._limits.body_timeout)

        def on_message_complete(self) -> None:
            self._in_head = True
            self._unparsed = 0
            self._deadline = None
            self._deferred = None
            super().on_message_complete()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self.transport.is_closing():
                return
            deferred, self._deferred = self._deferred, None
            if deferred is not None:  # a request is half in: no keep-alive wait
                self._unset_keepalive_if_required()
                self._expect(*deferred)
            elif self.timeout_keep_alive_task is not None and self._held is not None:
                self._held.idle[self] = None  # idle until its next byte

        def _answering(self) -> bool:
            """An answer is under way on this connection (a request now is pipelined)."""
            cycle = self.cycle
            return cycle is not None and not cycle.response_complete

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

        def _check(self, last: bool = False) -> None:
            """The timer: re-armed for a deadline that moved; past it, one last look
            (:data:`LAST_LOOK`) for bytes that arrived while the loop was held up, then
            the wait timed out."""
            self._timer = None
            deadline = self._deadline
            if deadline is None or self.transport.is_closing():
                return
            if self.loop.time() < deadline:
                self._timer = self.loop.call_at(deadline, self._check)
            elif not last:
                self._timer = self.loop.call_later(LAST_LOOK, self._check, True)
            else:
                self._timed_out()

        def timeout_keep_alive_handler(self) -> None:
            """uvicorn's keep-alive timer: the idle connection is closed after one last
            look (:data:`LAST_LOOK`) for a request that arrived while the loop was held
            up (reading it cancels the close, as it cancels this timer)."""
            close = super().timeout_keep_alive_handler
            self.timeout_keep_alive_task = self.loop.call_later(LAST_LOOK, close)

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
