"""The gateway's ASGI application.

Routes: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (JSON or SSE),
``POST /tokenize`` and ``POST /detokenize`` (forwarded to a decoder),
``GET /v1/models``, ``GET /version``, ``GET /health`` (the process is up),
``GET /ready`` (200 once a decoder passed a health check), ``GET /metrics``,
``GET /status`` and ``POST /admin/reload``. With ``auth.api_keys``, every route but
``/health``, ``/ready``, ``/metrics`` (and ``/admin/reload``, which has its own
token) needs a client key (:mod:`~pd_orchestrator.gateway.auth`).

A completion request goes straight down, and its result comes back up, in
:mod:`~pd_orchestrator.gateway.completion` (admission, the plan, the flow into the
client's renderer, learning, the span and access-log line).

On SIGTERM the server drains the gateway (:mod:`~pd_orchestrator.gateway.lifecycle`):
``/ready`` turns 503 and requests in flight get ``lifecycle.drain_seconds`` to end.

The completion routes are dispatched before Starlette's router (they are the hot
path); everything else goes through Starlette. Every request's head is checked
against ``limits`` first (:mod:`~pd_orchestrator.gateway.limits`), and every
error the gateway answers -- unknown routes and methods included -- is
``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import itertools
import logging
import signal
import time
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path

import anyio
from anyio.abc import TaskGroup, TaskStatus
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from pd_orchestrator.config.loader import ConfigError, load_config
from pd_orchestrator.config.settings import GatewayConfig
from pd_orchestrator.fleet.state import FleetState
from pd_orchestrator.flows.legs import Legs
from pd_orchestrator.flows.sink import GatewayError
from pd_orchestrator.gateway.admission import (
    RequestIds,
    header_map,
    read_json,
    request_id_of,
)
from pd_orchestrator.gateway.auth import OPEN_PATHS, ApiKeys, forwarded_headers, unauthorized
from pd_orchestrator.gateway.calibrate import calibrate, planned
from pd_orchestrator.gateway.completion import CompletionPath
from pd_orchestrator.gateway.lifecycle import Drain, closing_connections
from pd_orchestrator.gateway.limits import BodyKind, check_head
from pd_orchestrator.gateway.observe import Answered
from pd_orchestrator.gateway.passthrough import tokenizer_decoder, versions
from pd_orchestrator.gateway.protocol import Listener, limited_protocol
from pd_orchestrator.gateway.response import closing_headers, error_of, error_response, refuse
from pd_orchestrator.gateway.state import (
    GatewayState,
    ReloadResult,
    build_state,
    restart_notes,
)
from pd_orchestrator.gateway.status import models_document, ready_document, status_document
from pd_orchestrator.openai.errors import error_body
from pd_orchestrator.openai.responses import Kind
from pd_orchestrator.routing.registry import RoutingConfigError
from pd_orchestrator.telemetry.logs import REQUEST_ID
from pd_orchestrator.telemetry.metrics import GatewayMetrics
from pd_orchestrator.telemetry.tracing import Tracing
from pd_orchestrator.upstream.client import Phase, Upstream
from pd_orchestrator.upstream.transport import Transport

__all__ = ["Gateway"]

logger = logging.getLogger("pd_orchestrator.gateway")

_ROUTES: dict[str, Kind] = {"/v1/completions": "completion", "/v1/chat/completions": "chat"}


def _error(
    status: int, message: str, param: str | None = None, headers: Mapping[str, str] | None = None
) -> JSONResponse:
    return JSONResponse(error_body(message, status, param=param), status, headers=headers)


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("latin-1")).digest()


class Gateway:
    """One gateway instance: its state (config, fleet, planner), upstream client,
    metrics; an ASGI application (:meth:`app`).

    Raises :class:`~pd_orchestrator.routing.registry.RoutingConfigError` when the
    routing profiles name an unknown plugin or give it bad parameters. With a
    ``config_path``, SIGHUP and ``POST /admin/reload`` reload the configuration from
    it; see :meth:`reload`. ``tracing``: the tracer (default: the one ``config.tracing``
    configures, None when it configures none).
    """

    def __init__(
        self,
        config: GatewayConfig,
        *,
        config_path: Path | None = None,
        transport: Transport | None = None,
        clock: Callable[[], float] = time.monotonic,
        tracing: Tracing | None = None,
    ) -> None:
        self.clock = clock
        self.config_path = config_path
        self.metrics = GatewayMetrics()
        self.upstream = Upstream(config.upstream, config.timeouts, transport=transport)
        self.state = build_state(config, self.upstream, self.metrics, clock)
        self.tracing = tracing if tracing is not None else Tracing.from_config(config.tracing)
        self._api_keys = ApiKeys.configured(config.auth.api_keys)
        self._turns = itertools.count()
        self._ids = RequestIds()
        self._monitors: anyio.CancelScope | None = None
        self._tasks: TaskGroup | None = None
        self._reload_lock = anyio.Lock()
        self._router = self._starlette()
        self.drain = Drain()
        self.completions = CompletionPath(
            self.upstream, self.metrics, clock, self.tracing, self.drain, self._ids
        )

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

    def http_protocol(self, probe_port: int | None = None) -> Listener:
        """The HTTP protocol uvicorn serves this gateway with (it calls it for each
        connection, as it would a protocol class): the gateway's own, which enforces the
        head limits of the current configuration while a head arrives, and the
        connection caps (:mod:`~pd_orchestrator.gateway.protocol`); connections to
        local port ``probe_port`` are the probe port's."""
        return limited_protocol(lambda: self.state.config.limits, probe_port)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            if self.drain.draining:
                send = closing_connections(send)
            try:
                check_head(scope, self.state.config.limits)
            except GatewayError as exc:
                await refuse(send, exc)
                return
            keys = self._api_keys
            if keys is not None and scope["path"] not in OPEN_PATHS:
                if not keys.allows(scope["headers"]):
                    await unauthorized(send)
                    return
            kind = _ROUTES.get(scope["path"])
            if kind is not None:
                if scope["method"] == "POST":
                    own_keys = keys is not None
                    await self.completions.serve(self.state, own_keys, scope, receive, send, kind)
                else:
                    message = f"method {scope['method']} is not allowed on {scope['path']}"
                    await error_response(send, 405, message, None, {"allow": "POST"})
                return
        await self._router(scope, receive, send)

    def _starlette(self) -> Starlette:
        routes = [
            Route("/v1/models", self._models, methods=["GET"]),
            Route("/health", self._health, methods=["GET"]),
            Route("/ready", self._ready, methods=["GET"]),
            Route("/metrics", self._metrics, methods=["GET"]),
            Route("/status", self._status, methods=["GET"]),
            Route("/version", self._version, methods=["GET"]),
            Route("/tokenize", self._tokenizer, methods=["POST"]),
            Route("/detokenize", self._tokenizer, methods=["POST"]),
            Route("/admin/reload", self._admin_reload, methods=["POST"]),
        ]
        handlers = {HTTPException: self._http_error, Exception: self._internal_error}
        return Starlette(routes=routes, lifespan=self._lifespan, exception_handlers=handlers)

    async def _http_error(self, request: Request, exc: Exception) -> Response:
        """Starlette's 404 and 405 (and any HTTP error) in the OpenAI error shape."""
        assert isinstance(exc, HTTPException)
        method, path = request.method, request.url.path
        if exc.status_code == 404:
            message = f"there is no route {path}"
        elif exc.status_code == 405:
            message = f"method {method} is not allowed on {path}"
        else:
            message = exc.detail
        return _error(exc.status_code, message, headers=exc.headers)

    async def _internal_error(self, request: Request, exc: Exception) -> Response:
        """An unexpected error on a Starlette route (the server logs its traceback)."""
        return _error(500, f"internal error: {type(exc).__name__}")

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
                if self.tracing is not None:
                    with anyio.move_on_after(5, shield=True):
                        await anyio.to_thread.run_sync(
                            self.tracing.shutdown, abandon_on_cancel=True
                        )

    async def _start_monitors(self, state: GatewayState) -> None:
        """(Re)start health checks and load polls for ``state``'s fleet, then time the
        pools its ``goodput`` policies know nothing of
        (:func:`~pd_orchestrator.gateway.calibrate.calibrate`)."""
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
                    if state.config.sidecar.enabled:
                        await tg.start(state.allowlist.run)
                    if state.shared is not None:
                        await tg.start(state.shared.run)
                    probes = planned(state, self.clock)  # marked before the gateway is ready
                    task_status.started()
                    tg.start_soon(calibrate, state, self.upstream, self.clock, probes)

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
            self._api_keys = ApiKeys.configured(config.auth.api_keys)
            if self._tasks is not None:
                await self._start_monitors(state)
            self.metrics.reloads.labels("applied").inc()
            return ReloadResult(True, "applied" + (f" ({notes})" if notes else ""))

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

    async def _version(self, request: Request) -> Response:
        return JSONResponse(await versions(self.state, self.upstream))

    async def _tokenizer(self, request: Request) -> Response:
        """``POST /tokenize`` and ``/detokenize``, forwarded to a decoder
        (:mod:`~pd_orchestrator.gateway.passthrough`)."""
        state = self.state
        path = request.url.path
        started = self.clock()
        headers = header_map(request.scope["headers"])
        request_id = request_id_of(headers.get("x-request-id"), self._ids)
        REQUEST_ID.set(request_id)
        tracing = self.tracing
        trace = None if tracing is None else tracing.request("POST", path, headers)
        try:
            kind: BodyKind = "tokenize" if path == "/tokenize" else "detokenize"
            body = (await read_json(request.receive, state.config.limits, kind)).json
            decoder = tokenizer_decoder(state, body.get("model"), next(self._turns))
            forward = forwarded_headers(headers, own_keys=self._api_keys is not None, tracing=trace)
            legs = Legs(
                self.upstream, state.fleet, self.metrics, request_id, self.clock,
                forward=forward, trace=trace,
            )  # fmt: skip
            answer: dict[str, object] = await legs.post(decoder, path, body, Phase.TOKENIZE)
            status, error = 200, None
        except Exception as exc:  # every error in the OpenAI shape (error_of logs the rest)
            status, message, param = error_of(exc)
            answer, error = error_body(message, status, param=param), message
        self.metrics.count_request(path, "error" if status >= 400 else "none", status)
        self.completions.observe(state, trace, Answered("POST", path, status, None, error), started)
        headers = {"x-request-id": request_id, **closing_headers(status)}
        return JSONResponse(answer, status, headers=headers)

    async def _admin_reload(self, request: Request) -> Response:
        """``POST /admin/reload`` with ``Authorization: Bearer <admin.token>`` (the
        scheme is case-insensitive; nothing else is accepted). The token is compared in
        constant time, through digests so its length does not show either. 200
        ``{"reloaded": true, "message"}`` when applied; a refused file is a 422 error
        whose message says why."""
        token = self.config.admin.token
        if token is None:
            return _error(404, "the admin API is disabled (set admin.token)")
        scheme, _, offered = request.headers.get("authorization", "").partition(" ")
        valid = hmac.compare_digest(_digest(offered), _digest(token.get_secret_value()))
        if scheme.lower() != "bearer" or not valid:
            message = "a valid admin bearer token is required"
            return _error(401, message, headers={"www-authenticate": "Bearer"})
        result = await self.reload()
        if not result.applied:
            return _error(422, result.message)
        return JSONResponse({"reloaded": True, "message": result.message})
