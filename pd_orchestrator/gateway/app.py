"""The gateway's ASGI application.

Routes: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (JSON or SSE),
``GET /v1/models``, ``GET /health`` (the process is up), ``GET /ready`` (200 once
a decoder passed a health check), ``GET /metrics``, ``GET /status`` and
``POST /admin/reload``.

A completion request goes straight down, and its result comes back up:

1. admission (:mod:`~pd_orchestrator.gateway.admission`): read, parse once, check;
2. the planner (pure): the whole plan over a snapshot of the fleet;
3. the flow, through the request's legs, into the client's renderer
   (:func:`~pd_orchestrator.gateway.response.respond` watches for a disconnect);
4. the gateway learns from the flow's outcome after it returned (metrics, the
   planner's learning plugins and threshold feedback).

On SIGTERM the server drains the gateway (:mod:`~pd_orchestrator.gateway.lifecycle`):
``/ready`` turns 503 and requests in flight get ``lifecycle.drain_seconds`` to end.

The completion routes are dispatched before Starlette's router (they are the hot
path); everything else goes through Starlette.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import secrets
import signal
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from functools import partial
from pathlib import Path

import anyio
from anyio.abc import TaskGroup, TaskStatus
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from pd_orchestrator.config.loader import ConfigError, load_config
from pd_orchestrator.config.settings import GatewayConfig
from pd_orchestrator.fleet.state import FleetState
from pd_orchestrator.flows.flow import Flow, Outcome
from pd_orchestrator.flows.legs import Legs
from pd_orchestrator.flows.render import renderer_for
from pd_orchestrator.flows.sink import ClientSink, GatewayError
from pd_orchestrator.gateway.admission import Admitted, RequestIds, admit, header_map
from pd_orchestrator.gateway.lifecycle import SHUTTING_DOWN, Drain, closing_connections
from pd_orchestrator.gateway.response import error_response, respond
from pd_orchestrator.gateway.state import (
    GatewayState,
    ReloadResult,
    build_state,
    restart_notes,
)
from pd_orchestrator.gateway.status import models_document, ready_document, status_document
from pd_orchestrator.openai.errors import error_body
from pd_orchestrator.openai.responses import Kind
from pd_orchestrator.planner.plan import NoCandidateError, Plan, Served
from pd_orchestrator.routing.registry import RoutingConfigError
from pd_orchestrator.routing.types import Candidate
from pd_orchestrator.telemetry.metrics import GatewayMetrics
from pd_orchestrator.upstream.client import Upstream
from pd_orchestrator.upstream.transport import Transport

__all__ = ["Gateway"]

logger = logging.getLogger("pd_orchestrator.gateway")

_ROUTES: dict[str, Kind] = {"/v1/completions": "completion", "/v1/chat/completions": "chat"}


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, param=param), status)


async def _read_body(receive: Receive) -> bytes:
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise GatewayError(499, "the client disconnected")
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


class Gateway:
    """One gateway instance: its state (config, fleet, planner), upstream client,
    metrics; an ASGI application (:meth:`app`).

    Raises :class:`~pd_orchestrator.routing.registry.RoutingConfigError` when the
    routing profiles name an unknown plugin or give it bad parameters. With a
    ``config_path``, SIGHUP and ``POST /admin/reload`` reload the configuration from
    it; see :meth:`reload`.
    """

    def __init__(
        self,
        config: GatewayConfig,
        *,
        config_path: Path | None = None,
        transport: Transport | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.clock = clock
        self.config_path = config_path
        self.metrics = GatewayMetrics()
        self.upstream = Upstream(config.upstream, config.timeouts, transport=transport)
        self.state = build_state(config, self.upstream, self.metrics, clock)
        self._ordinals = itertools.count()
        self._ids = RequestIds()
        self._monitors: anyio.CancelScope | None = None
        self._tasks: TaskGroup | None = None
        self._reload_lock = anyio.Lock()
        self._router = self._starlette()
        self.drain = Drain()

    @property
    def config(self) -> GatewayConfig:
        return self.state.config

    @property
    def fleet(self) -> FleetState:
        return self.state.fleet

    # -- application --------------------------------------------------------------------
    def app(self) -> Gateway:
        """The ASGI application (the gateway itself)."""
        return self

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.drain.draining and scope["type"] == "http":
            send = closing_connections(send)
        if scope["type"] == "http" and scope["method"] == "POST":
            kind = _ROUTES.get(scope["path"])
            if kind is not None:
                await self._completion(scope, receive, send, kind)
                return
        await self._router(scope, receive, send)

    def _starlette(self) -> Starlette:
        routes = [
            Route("/v1/models", self._models, methods=["GET"]),
            Route("/health", self._health, methods=["GET"]),
            Route("/ready", self._ready, methods=["GET"]),
            Route("/metrics", self._metrics, methods=["GET"]),
            Route("/status", self._status, methods=["GET"]),
            Route("/admin/reload", self._admin_reload, methods=["POST"]),
        ]
        return Starlette(routes=routes, lifespan=self._lifespan)

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        async with anyio.create_task_group() as tg:
            self._tasks = tg
            await self._start_monitors(self.state)
            if self.config_path is not None:
                tg.start_soon(self._reload_on_sighup)
            try:
                yield
            finally:
                tg.cancel_scope.cancel()
                with anyio.move_on_after(2, shield=True):
                    await self.upstream.aclose()

    async def _start_monitors(self, state: GatewayState) -> None:
        """(Re)start health checks and load polls for ``state``'s fleet."""
        assert self._tasks is not None
        if self._monitors is not None:
            self._monitors.cancel()
        scope = self._monitors = anyio.CancelScope()

        async def monitors(*, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
            with scope:
                async with anyio.create_task_group() as tg:
                    await tg.start(state.health.run)
                    await tg.start(state.scraper.run)
                    await tg.start(state.prefix.run)
                    task_status.started()

        await self._tasks.start(monitors)

    # -- reload ----------------------------------------------------------------------------
    async def _reload_on_sighup(self) -> None:
        with anyio.open_signal_receiver(signal.SIGHUP) as signals:
            async for _ in signals:
                result = await self.reload()
                logger.warning("SIGHUP reload: %s", result.message)

    async def reload(self) -> ReloadResult:
        """Reload the configuration file; the old state stays if the new one is invalid.

        In-flight requests finish with the state they started with; new requests use
        the new one. ``listen`` keeps its running value; ``upstream`` and ``timeouts``
        changes need a restart (the result says so).
        """
        async with self._reload_lock:
            if self.config_path is None:
                return ReloadResult(False, "this gateway was not started from a file")
            try:
                config = load_config(self.config_path).model_copy(
                    update={"listen": self.config.listen}
                )
                state = build_state(config, self.upstream, self.metrics, self.clock, self.state)
            except (ConfigError, RoutingConfigError, ValueError) as exc:
                self.metrics.reloads.labels("refused").inc()
                return ReloadResult(False, f"refused, the old configuration stays: {exc}")
            notes = restart_notes(self.config, config)
            self.state = state
            if self._tasks is not None:
                await self._start_monitors(state)
            self.metrics.reloads.labels("applied").inc()
            return ReloadResult(True, "applied" + (f" ({notes})" if notes else ""))

    # -- completions ------------------------------------------------------------------------
    async def _completion(self, scope: Scope, receive: Receive, send: Send, kind: Kind) -> None:
        """One completion request, top to bottom (see the module docstring)."""
        drain = self.drain
        drain.requests += 1
        try:
            await self._complete(scope, receive, send, kind)
        finally:
            drain.requests -= 1

    async def _complete(self, scope: Scope, receive: Receive, send: Send, kind: Kind) -> None:
        state = self.state
        path = scope["path"]
        try:
            admitted, plan = await self._plan(state, scope, receive, kind, path)
            if self.drain.closing:
                raise GatewayError(503, SHUTTING_DOWN)
        except GatewayError as exc:
            self.metrics.count_request(path, "error", exc.status)
            if exc.status != 499:
                await error_response(send, exc.status, exc.message, exc.param)
            return
        request_id = admitted.request.request_id
        legs = Legs(self.upstream, state.fleet, self.metrics, request_id, self.clock)
        flow = Flow(admitted.request, plan, legs, state.attempt, state.flow)
        self.metrics.in_flight.inc()
        try:
            serve = partial(self._run, flow)
            pending = await respond(receive, send, serve, flow.headers, self.drain.scopes)
            self._learn(state, admitted, plan, pending.result)
            status = await pending.finish()
        finally:
            self.metrics.in_flight.dec()
        self._count(path, pending.result, status)

    async def _plan(
        self, state: GatewayState, scope: Scope, receive: Receive, kind: Kind, path: str
    ) -> tuple[Admitted, Plan]:
        raw = await _read_body(receive)
        now = self.clock()
        headers = header_map(scope["headers"])
        admitted = admit(state, kind, path, raw, headers, now, self._ids)
        candidates = state.scraper.candidates(state.fleet.snapshot(), now)
        admitted = await self._tokenized(state, admitted, candidates)
        try:
            plan = state.planner.plan(admitted.facts, candidates, now, next(self._ordinals))
        except NoCandidateError as exc:
            raise GatewayError(503, str(exc)) from None
        self.metrics.record_threshold(plan.threshold)
        return admitted, plan

    async def _tokenized(
        self, state: GatewayState, admitted: Admitted, candidates: tuple[Candidate, ...]
    ) -> Admitted:
        """``admitted`` with the prompt's token ids from a decoder, when the precise
        prefix index wants them (``prefix.precise.tokenize``)."""
        facts = admitted.facts
        if not state.prefix.needs_tokens(facts.fields):
            return admitted
        decoders = [c.endpoint for c in candidates if c.healthy and c.endpoint.role.decodes]
        if not decoders:
            return admitted
        request = admitted.request
        fields = await state.prefix.tokenized(
            facts.fields,
            request.body,
            chat=request.kind == "chat",
            upstream=self.upstream,
            endpoint=decoders[0],
        )
        return Admitted(request, replace(facts, fields=fields))

    async def _run(self, flow: Flow, sink: ClientSink) -> Outcome:
        renderer = renderer_for(flow.request, flow.transcript, sink, self.clock)
        return await flow.run(renderer)

    def _learn(
        self, state: GatewayState, admitted: Admitted, plan: Plan, outcome: Outcome | None
    ) -> None:
        """After the flow, before its answer ends: teach the planner what it did."""
        if outcome is None:
            return
        served = Served(
            outcome.decoder, self.clock(), outcome.ttft, outcome.itl, outcome.prompt_tokens
        )
        state.planner.learn(plan, admitted.facts, served)

    def _count(self, path: str, outcome: Outcome | None, status: int) -> None:
        """Count one answered request by route, decision and status."""
        decision = "error" if outcome is None or status >= 400 else outcome.decision
        self.metrics.count_request(path, decision, status)
        if decision != "error" and outcome is not None and outcome.ttft is not None:
            self.metrics.ttft.observe(outcome.ttft)

    # -- other routes -----------------------------------------------------------------------
    async def _health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def _ready(self, request: Request) -> Response:
        document, status = ready_document(self.state, draining=self.drain.draining)
        return JSONResponse(document, status)

    async def _metrics(self, request: Request) -> Response:
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def _status(self, request: Request) -> Response:
        """Endpoints (by name) with health, in-flight requests and their latest load."""
        return JSONResponse(status_document(self.state, self.clock()))

    async def _models(self, request: Request) -> Response:
        return JSONResponse(models_document(self.state))

    async def _admin_reload(self, request: Request) -> Response:
        """``POST /admin/reload`` with ``Authorization: Bearer <admin.token>``."""
        token = self.config.admin.token
        if token is None:
            return _error(404, "the admin API is disabled (set admin.token)")
        offered = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        if not secrets.compare_digest(offered.encode(), token.get_secret_value().encode()):
            return _error(401, "a valid admin bearer token is required")
        result = await self.reload()
        status = 200 if result.applied else 422
        return JSONResponse({"reloaded": result.applied, "message": result.message}, status)
