"""Where a flow writes its answer, and the errors a flow raises for the client."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

__all__ = ["ClientSink", "GatewayError"]


class GatewayError(Exception):
    """An answer the gateway itself decides: HTTP status, message, offending parameter."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


class ClientSink(Protocol):
    """The client's side of a response.

    A flow calls :meth:`start` exactly once (status and headers), then
    :meth:`send` for each piece of the body. Errors raised before :meth:`start`
    become a JSON error answer; after it, an SSE error event.
    """

    @property
    def started(self) -> bool: ...

    async def start(self, status: int, headers: Mapping[str, str], media_type: str) -> None: ...

    async def send(self, data: bytes) -> None: ...
