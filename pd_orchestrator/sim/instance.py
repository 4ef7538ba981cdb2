"""What the routes of one simulated instance share, and their HTTP helpers.

:class:`Instance` holds the instance's parts (options, engine, runner, metrics,
tokenizer, its identity on the KV side channels and the HTTP client its consumer
side pulls KV with); the routes live in :mod:`~pd_orchestrator.sim.server` (the
HTTP front: health, models, metrics, tokenizer, cache reset),
:mod:`~pd_orchestrator.sim.completions` (the generation requests) and
:mod:`~pd_orchestrator.sim.side_channels` (the KV producer side).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import anyio
import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pd_orchestrator.openai.errors import error_body
from pd_orchestrator.openai.protocol import RequestError, decode_json_object
from pd_orchestrator.sim.engine import Engine
from pd_orchestrator.sim.handover import Advertised
from pd_orchestrator.sim.metrics import SimMetrics
from pd_orchestrator.sim.options import SimOptions
from pd_orchestrator.sim.runner import EngineRunner
from pd_orchestrator.sim.tokenizer import SimTokenizer

__all__ = [
    "HTTPFailure",
    "Instance",
    "check_vocab",
    "json_object",
    "list_field",
    "until_disconnect",
    "wrap",
]


class HTTPFailure(Exception):
    """An error answer: HTTP status, message, and the offending parameter if any."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, self.status, param=self.param), self.status)


@dataclass
class Instance:
    """One simulated instance's parts (see the module docstring). ``port``: where it
    listens (set once its socket is bound); ``client``: set while the app runs."""

    options: SimOptions
    model: str
    engine_id: str
    port: int
    clock: Callable[[], float]
    tokenizer: SimTokenizer
    connectors: tuple[str, ...]
    engine: Engine
    runner: EngineRunner
    metrics: SimMetrics
    client: httpx.AsyncClient | None = None

    def advertised(self) -> Advertised:
        """This instance on the KV side channels: engine id, host and port."""
        options = self.options
        return Advertised(self.engine_id, options.side_channel_host or options.host, self.port)


def wrap(
    handler: Callable[[Request], Awaitable[Response]],
) -> Callable[[Request], Awaitable[Response]]:
    """``handler`` answering its :class:`HTTPFailure` as an error answer."""

    async def endpoint(request: Request) -> Response:
        try:
            return await handler(request)
        except HTTPFailure as failure:
            return failure.response()

    return endpoint


async def until_disconnect(
    request: Request, work: Coroutine[Any, Any, dict[str, Any]]
) -> dict[str, Any] | None:
    """Run ``work`` unless the client disconnects first (vLLM aborts such requests)."""
    result: dict[str, Any] | None = None
    async with anyio.create_task_group() as tg:

        async def watch() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            tg.cancel_scope.cancel()

        tg.start_soon(watch)
        result = await work
        tg.cancel_scope.cancel()
    return result


async def json_object(request: Request) -> dict[str, Any]:
    """The request's body, a JSON object (else a 400)."""
    try:
        return decode_json_object(await request.body())
    except RequestError as exc:
        raise HTTPFailure(400, str(exc)) from None


def list_field(body: dict[str, Any], name: str) -> list[Any]:
    """``body[name]``, a list (else a 400)."""
    value = body.get(name)
    if not isinstance(value, list):
        raise HTTPFailure(400, f"{name}: a list is required", name)
    return value


def check_vocab(tokenizer: SimTokenizer, ids: list[int]) -> None:
    """A 400 when ``ids`` are not all in the vocabulary."""
    try:
        tokenizer.validate(ids)
    except ValueError as exc:
        raise HTTPFailure(400, str(exc), "prompt") from None
