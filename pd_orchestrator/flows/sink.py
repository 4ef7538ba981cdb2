"""Where a flow writes its answer, and the errors a flow raises for the client."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

__all__ = ["ClientSink", "GatewayError", "check_token_ids"]


class GatewayError(Exception):
    """An answer the gateway itself decides: HTTP status, message, offending parameter."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


def check_token_ids(count: int, limit: int, param: str = "prompt") -> None:
    """Refuse ``count`` token ids past ``limit`` (``limits.max_prompt_token_ids``;
    400), however the gateway came by them: a client's ``param``, or a decoder's
    ``/tokenize`` of the prompt."""
    if count > limit:
        raise GatewayError(400, f"`{param}` has more than {limit} token ids", param)


class ClientSink(Protocol):
    """The client's side of a response.

    A flow calls :meth:`start` exactly once (status and headers), then :meth:`send`
    for each piece of the body and :meth:`end` with the last piece; or :meth:`answer`
    once with the whole answer. Errors raised before either become a JSON error
    answer; after :meth:`start` of a stream, an SSE error event. The last piece (or
    the whole answer) is held until the gateway closes the response, so the gateway
    learns from a request before its client can send the next one.
    """

    @property
    def started(self) -> bool: ...

    async def start(self, status: int, headers: Mapping[str, str], media_type: str) -> None: ...

    async def send(self, data: bytes) -> None: ...

    def end(self, data: bytes) -> None:
        """The last piece of a started body (sent when the response is closed)."""
        ...

    def answer(self, status: int, headers: Mapping[str, str], body: bytes) -> None:
        """A whole JSON answer of ``body`` (sent when the response is closed)."""
        ...
