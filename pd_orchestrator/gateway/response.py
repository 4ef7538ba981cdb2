"""An ASGI response that runs a flow and watches the client at the same time.

The flow and a disconnect watcher share one task group: when the client goes, the
flow is cancelled, and the flow's cleanup closes its upstream connections (which
is how vLLM learns to abort). Errors raised before the flow started the response
become a JSON error answer with their status; after it, an SSE error event in
vLLM's shape followed by ``[DONE]``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, Mapping

import anyio
from starlette.types import Message, Receive, Scope, Send

from pd_orchestrator.flows.sink import ClientSink, GatewayError
from pd_orchestrator.openai.errors import error_body
from pd_orchestrator.openai.sse import DONE, encode_event
from pd_orchestrator.upstream.errors import UpstreamError, client_error

__all__ = ["FlowResponse", "error_of"]

FlowRunner = Callable[[ClientSink], Awaitable[None]]
logger = logging.getLogger("pd_orchestrator.gateway")


def error_of(exc: Exception) -> tuple[int, str, str | None]:
    """Status, message and parameter of an error a flow raised."""
    if isinstance(exc, GatewayError):
        return exc.status, exc.message, exc.param
    if isinstance(exc, UpstreamError):
        mapped = client_error(exc)
        return mapped.status, mapped.message, mapped.param
    logger.error("unexpected error while serving a request", exc_info=exc)
    return 500, f"internal error: {type(exc).__name__}", None


class _AsgiSink:
    def __init__(self, send: Send) -> None:
        self._send = send
        self.started = False
        self.status = 0
        self.streaming = False

    async def start(self, status: int, headers: Mapping[str, str], media_type: str) -> None:
        if self.started:
            raise RuntimeError("the response was already started")
        self.started = True
        self.status = status
        self.streaming = media_type == "text/event-stream"
        raw = [(b"content-type", media_type.encode())]
        if self.streaming:
            raw.append((b"cache-control", b"no-cache"))
        raw += [(k.lower().encode(), v.encode()) for k, v in headers.items()]
        await self._send({"type": "http.response.start", "status": status, "headers": raw})

    async def send(self, data: bytes) -> None:
        await self._send({"type": "http.response.body", "body": data, "more_body": True})

    async def finish(self) -> None:
        await self._send({"type": "http.response.body", "body": b"", "more_body": False})


class FlowResponse:
    """Run ``runner`` against the client; ``on_done(status, error)`` reports the outcome."""

    def __init__(
        self,
        runner: FlowRunner,
        on_done: Callable[[int, Exception | None], None],
        error_headers: Callable[[], Mapping[str, str]] = dict,
    ) -> None:
        self.runner = runner
        self.on_done = on_done
        self.error_headers = error_headers

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        sink = _AsgiSink(send)
        error: Exception | None = None
        disconnected = False
        async with anyio.create_task_group() as tg:

            async def watch() -> None:
                nonlocal disconnected
                while True:
                    message: Message = await receive()
                    if message["type"] == "http.disconnect":
                        disconnected = True
                        tg.cancel_scope.cancel()
                        return

            tg.start_soon(watch)
            try:
                await self.runner(sink)
            except Exception as exc:
                error = exc
            tg.cancel_scope.cancel()
        if disconnected:
            self.on_done(499, None)
            return
        try:
            await self._close(sink, error)
        except OSError:
            self.on_done(499, error)
            return
        self.on_done(sink.status, error)

    async def _close(self, sink: _AsgiSink, error: Exception | None) -> None:
        if error is None:
            await sink.finish()
            return
        status, message, param = error_of(error)
        body = error_body(message, status, param=param)
        if not sink.started:
            await sink.start(status, self.error_headers(), "application/json")
            await sink.send(json.dumps(body).encode())
        elif sink.streaming:
            await sink.send(encode_event(body))
            await sink.send(DONE)
        await sink.finish()
