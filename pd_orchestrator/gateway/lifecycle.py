"""The gateway's drain: from SIGTERM (or SIGINT) to the process's exit.

1. At once (:meth:`Drain.begin`, from the signal handler): ``/ready`` answers 503,
   every answer on a connection still open carries ``Connection: close``
   (:func:`closing_connections`), and the server closes its listening sockets, so no
   new connection is accepted.
2. Requests in flight, and those that still arrive on open connections, may finish
   for ``lifecycle.drain_seconds`` (:meth:`Drain.run`). The drain lasts until every
   connection has closed, not only until nothing is in flight: a connection closes
   after its next answer, or when it has been idle for ``limits.keepalive_timeout``
   (or its request timed out, ``limits.header_timeout`` and ``body_timeout``), so a
   request a client sends on an idle keep-alive connection after the signal is
   served (with ``Connection: close``) instead of being cut with the connection.
3. Then every request still in flight is cancelled: its upstream legs are closed
   (that is how vLLM learns to abort), a stream already started ends with one SSE
   error event in vLLM's shape and ``[DONE]``, an answer not yet started is a 503 in
   the same shape (:func:`~pd_orchestrator.gateway.response.respond` does both). A
   request that arrives after this point is a 503 at once.
4. The server closes the connections left and the process exits.

A second SIGINT (uvicorn's force exit) cuts the waits short.
"""

from __future__ import annotations

from collections.abc import Callable

import anyio
from starlette.types import Message, Send

__all__ = ["END_SECONDS", "SHUTTING_DOWN", "Drain", "closing_connections"]

END_SECONDS = 5.0
"""How long requests ended at the end of the drain may take to write their error."""
SHUTTING_DOWN = "the gateway is shutting down; send the request again"
_POLL = 0.05


class Drain:
    """The drain state of one gateway (see the module docstring).

    ``requests``: completion requests in progress (the gateway counts them);
    ``scopes``: their cancel scopes while they are served (``respond`` keeps them);
    ``draining``: since the signal; ``closing``: since the grace ran out.
    """

    def __init__(self) -> None:
        self.draining = False
        self.closing = False
        self.requests = 0
        self.scopes: set[anyio.CancelScope] = set()

    def begin(self) -> None:
        """Start draining (safe in a signal handler: it only sets a flag)."""
        self.draining = True

    async def run(
        self,
        grace: float,
        forced: Callable[[], bool] = lambda: False,
        connections: Callable[[], int] = lambda: 0,
    ) -> int:
        """Let requests finish, and open connections close, for ``grace`` seconds, then
        end the requests left; returns how many were ended. ``connections()``: how many
        client connections are open; ``forced()`` true stops waiting."""
        self.begin()
        with anyio.move_on_after(grace):
            await self._settled(forced, connections)
        self.closing = True
        ended = len(self.scopes)
        for scope in list(self.scopes):
            scope.cancel()
        with anyio.move_on_after(END_SECONDS):
            await self._settled(forced)
        return ended

    async def _settled(
        self, forced: Callable[[], bool], connections: Callable[[], int] = lambda: 0
    ) -> None:
        """Until no request is in flight and no connection is open, or ``forced()``."""
        while (self.requests or connections()) and not forced():  # noqa: ASYNC110 - no event to wait on
            await anyio.sleep(_POLL)


def closing_connections(send: Send) -> Send:
    """``send`` whose answers carry ``Connection: close`` (the client goes elsewhere
    for its next request)."""

    async def closing(message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = [h for h in message.get("headers", []) if h[0].lower() != b"connection"]
            message = {**message, "headers": [*headers, (b"connection", b"close")]}
        await send(message)

    return closing
