"""Answering one client: a flow run against an ASGI connection, watched for disconnects.

:func:`respond` runs ``serve(sink)`` in a cancel scope that a disconnect watcher
cancels: when the client goes, the flow is cancelled, and the flow's cleanup closes its
upstream connections (which is how vLLM learns to abort). The answer's last piece
(or the whole answer) is held: :func:`respond` returns a :class:`Pending` answer,
the gateway learns from it, then :meth:`Pending.finish` sends the rest -- so a
client never sends its next request before the gateway learned from this one.

Errors raised before the flow started the response become a JSON error answer
with their status; after it, an SSE error event in vLLM's shape followed by
``[DONE]``. A request the gateway cancels itself (its drain ran out of time) ends
the same way, with a 503. :func:`error_response` answers an error on its own (admission refusals),
in the same shape.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Generic, TypeVar

import anyio
import orjson
from starlette.types import Message, Receive, Scope, Send

from pd_orchestrator.flows.sink import ClientSink, GatewayError
from pd_orchestrator.gateway.lifecycle import SHUTTING_DOWN
from pd_orchestrator.gateway.limits import REFUSALS_THAT_CLOSE
from pd_orchestrator.gateway.protocol import DISCONNECTS, Disconnects
from pd_orchestrator.openai.errors import error_body
from pd_orchestrator.openai.sse import DONE, encode_event
from pd_orchestrator.upstream.errors import UpstreamError, client_error

__all__ = [
    "DISCONNECTED",
    "Pending",
    "closing_headers",
    "disconnects_of",
    "error_of",
    "error_response",
    "refuse",
    "respond",
]

T = TypeVar("T")
logger = logging.getLogger("pd_orchestrator.gateway")
upstream_logger = logging.getLogger("pd_orchestrator.upstream")
DISCONNECTED = 499
"""The status recorded for a client that left before its answer ended."""
_JSON = "application/json"


def error_of(exc: Exception) -> tuple[int, str, str | None]:
    """Status, message and parameter of an error a flow raised.

    A body the JSON encoder refuses is the client's (400; every body the gateway
    encodes is made of a client's). Anything else unexpected is a 500, logged
    (:func:`_log_unexpected`: its traceback once per place it is raised).

    An upstream failure is logged in full (``pd_orchestrator.upstream``: endpoint,
    phase, status and the upstream's own message; WARNING, or INFO for an upstream
    4xx passed on as the client's error) unless the legs logged it already where
    the leg failed (``exc.logged``); the client gets the gateway's words for it
    (:func:`~pd_orchestrator.upstream.errors.client_error`).
    """
    if isinstance(exc, GatewayError):
        return exc.status, exc.message, exc.param
    if isinstance(exc, UpstreamError):
        mapped = client_error(exc)
        if exc.logged:  # the legs logged it where the leg failed
            return mapped.status, mapped.message, mapped.param
        upstream_logger.log(
            logging.INFO if mapped.status < 500 else logging.WARNING,
            "%s %s failed during %s (%s): %s; answered %d",
            exc.role or "endpoint",
            exc.endpoint,
            exc.phase,
            type(exc).__name__,
            exc.message,
            mapped.status,
        )
        return mapped.status, mapped.message, mapped.param
    if isinstance(exc, orjson.JSONEncodeError):  # only bodies made of a client's are encoded
        logger.info("a request body could not be encoded for upstream: %s", exc)
        return 400, "the request body cannot be forwarded as JSON", None
    _log_unexpected(exc)
    return 500, f"internal error: {type(exc).__name__}", None


_TRACED: set[tuple[str, str, int]] = set()
"""Where unexpected errors were raised (type, file, line) whose traceback was logged."""
_MAX_TRACED = 256


def _log_unexpected(exc: Exception) -> None:
    """Log an unexpected error at ERROR: with its traceback the first time it is
    raised where it was, in one line after that (a client that can set it off
    repeatedly does not fill the log with tracebacks)."""
    frame = exc.__traceback__
    while frame is not None and frame.tb_next is not None:
        frame = frame.tb_next
    code = frame.tb_frame.f_code.co_filename if frame is not None else ""
    where = (type(exc).__name__, code, frame.tb_lineno if frame is not None else 0)
    if where in _TRACED:
        logger.error(
            "unexpected error while serving a request (traceback logged before): %s: %s",
            where[0], exc,
        )  # fmt: skip
        return
    if len(_TRACED) < _MAX_TRACED:
        _TRACED.add(where)
    logger.error("unexpected error while serving a request", exc_info=exc)


class _AsgiSink:
    """A :class:`~pd_orchestrator.flows.sink.ClientSink` over an ASGI ``send``."""

    def __init__(self, send: Send) -> None:
        self._send = send
        self.started = False
        self.status = 0
        self.streaming = False
        self.tail = b""
        self._whole: tuple[int, Mapping[str, str], bytes] | None = None

    async def start(self, status: int, headers: Mapping[str, str], media_type: str) -> None:
        await self._start(status, headers, media_type, None)

    async def _start(
        self, status: int, headers: Mapping[str, str], media_type: str, length: int | None
    ) -> None:
        if self.started:
            raise RuntimeError("the response was already started")
        self.started = True
        self.status = status
        self.streaming = media_type == "text/event-stream"
        raw = [(b"content-type", media_type.encode())]
        if self.streaming:
            raw.append((b"cache-control", b"no-cache"))
        if length is not None:
            raw.append((b"content-length", b"%d" % length))
        raw += [(k.lower().encode(), v.encode()) for k, v in headers.items()]
        await self._send({"type": "http.response.start", "status": status, "headers": raw})

    async def send(self, data: bytes) -> None:
        await self._send({"type": "http.response.body", "body": data, "more_body": True})

    def end(self, data: bytes) -> None:
        self.tail += data

    def answer(self, status: int, headers: Mapping[str, str], body: bytes) -> None:
        self.status = status
        self._whole = (status, headers, body)

    @property
    def answered(self) -> bool:
        return self.started or self._whole is not None

    async def finish(self) -> None:
        """Send what is held and end the response."""
        if self._whole is not None:
            status, headers, body = self._whole
            await self._start(status, headers, _JSON, len(body))
            await self._send({"type": "http.response.body", "body": body, "more_body": False})
            return
        tail, self.tail = self.tail, b""
        await self._send({"type": "http.response.body", "body": tail, "more_body": False})


async def error_response(
    send: Send,
    status: int,
    message: str,
    param: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> None:
    """A whole JSON error answer in vLLM's shape."""
    sink = _AsgiSink(send)
    sink.answer(status, headers or {}, orjson.dumps(error_body(message, status, param=param)))
    await sink.finish()


def closing_headers(status: int) -> dict[str, str]:
    """The headers of a refusal with ``status``: one that leaves the request unread
    also closes the connection."""
    return {"connection": "close"} if status in REFUSALS_THAT_CLOSE else {}


async def refuse(send: Send, exc: GatewayError) -> None:
    """Answer a refusal (see :func:`closing_headers`)."""
    await error_response(send, exc.status, exc.message, exc.param, closing_headers(exc.status))


class Pending(Generic[T]):
    """An answer whose flow has run and whose last bytes are still held.

    ``status``: what the client will get (499: it left). ``result``: what ``serve``
    returned (None when it failed). ``error``: what it raised, if anything.
    """

    def __init__(
        self,
        sink: _AsgiSink,
        result: T | None,
        error: Exception | None,
        headers: Callable[[], Mapping[str, str]],
        disconnected: bool,
    ) -> None:
        self._sink = sink
        self._headers = headers
        self.result = result if error is None else None
        self.error = error
        self._mapped = None if error is None else error_of(error)
        if disconnected:
            self.status = DISCONNECTED
        elif self._mapped is not None and not sink.answered:
            self.status = self._mapped[0]
        else:
            self.status = sink.status

    async def finish(self) -> int:
        """Send the rest of the answer (or the error); the final status."""
        if self.status == DISCONNECTED:
            return DISCONNECTED
        try:
            await self._finish()
        except OSError:
            self.status = DISCONNECTED
        return self.status

    async def _finish(self) -> None:
        sink = self._sink
        if self._mapped is not None:
            status, message, param = self._mapped
            body = error_body(message, status, param=param)
            if not sink.answered:
                sink.answer(status, self._headers(), orjson.dumps(body))
            elif sink.streaming:
                sink.end(encode_event(body) + DONE)
        await sink.finish()


class _Watch:
    """Cancels ``scope`` when the client disconnects.

    On the gateway's own protocol the connection's :class:`Disconnects` calls it back
    when the connection is lost: no task per request. On any other server (the scope
    offers no such extension) the request body has been read, so the server's next
    message is the disconnect (or nothing, until the answer is complete), and one plain
    asyncio task waits for it.
    """

    def __init__(
        self, receive: Receive, scope: anyio.CancelScope, disconnects: Disconnects | None
    ) -> None:
        self.scope = scope
        self.disconnected = False
        self._disconnects = disconnects
        self._task: asyncio.Future[Message] | None = None
        if disconnects is not None:
            disconnects.add(self._lost)
        else:
            self._task = asyncio.ensure_future(receive())
            self._task.add_done_callback(self._seen)

    def _lost(self) -> None:
        self.disconnected = True
        self.scope.cancel()

    def _seen(self, task: asyncio.Future[Message]) -> None:
        if task.cancelled() or task.exception() is not None:
            return
        if task.result()["type"] == "http.disconnect":
            self._lost()

    def stop(self) -> None:
        if self._disconnects is not None:
            self._disconnects.discard(self._lost)
        if self._task is not None:
            self._task.remove_done_callback(self._seen)
            self._task.cancel()


def disconnects_of(scope: Scope) -> Disconnects | None:
    """The request's connection's :class:`Disconnects`, when its server offers it
    (the gateway's protocol does)."""
    extension = (scope.get("extensions") or {}).get(DISCONNECTS)
    found = None if extension is None else extension.get("connection")
    return found if isinstance(found, Disconnects) else None


async def respond(
    receive: Receive,
    send: Send,
    serve: Callable[[ClientSink], Awaitable[T]],
    error_headers: Callable[[], Mapping[str, str]] = dict,
    tracked: set[anyio.CancelScope] | None = None,
    disconnects: Disconnects | None = None,
) -> Pending[T]:
    """Run ``serve`` against the client (see the module docstring). ``tracked`` holds
    the request's cancel scope while ``serve`` runs: cancelling it from there ends
    the request with a 503 (``SHUTTING_DOWN``). ``disconnects``: the connection's
    (:func:`disconnects_of`), which tells of a disconnect without a task waiting on
    ``receive``; None on a server that offers none."""
    sink = _AsgiSink(send)
    error: Exception | None = None
    result: T | None = None
    with anyio.CancelScope() as scope:
        watch = _Watch(receive, scope, disconnects)
        if tracked is not None:
            tracked.add(scope)
        try:
            result = await serve(sink)
        except Exception as exc:
            error = exc
        finally:
            watch.stop()
            if tracked is not None:
                tracked.discard(scope)
    if scope.cancel_called and result is None and not watch.disconnected:
        error = GatewayError(503, SHUTTING_DOWN)
    return Pending(sink, result, error, error_headers, watch.disconnected)
