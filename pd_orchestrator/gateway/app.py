"""The gateway's ASGI application.

Routes: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (JSON or SSE),
``GET /v1/models``, ``GET /health`` (the process is up), ``GET /ready`` (200 once
a decoder passed a health check), ``GET /metrics``.

A completion request is parsed once into a typed view (bad input: 400 in vLLM's
error shape), checked against the served models (404) and, in sidecar mode,
against the prefiller allow-list (403); then planned by the routing pipeline
(pure, over a snapshot of health and load) and served by the decode-first or the
ask-all flow.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import secrets
import signal
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx
from anyio.abc import TaskGroup, TaskStatus
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from connectors import Connector, get_connector
from pd_orchestrator.config.loader import ConfigError, load_config
from pd_orchestrator.config.settings import GatewayConfig
from pd_orchestrator.fleet.endpoints import Endpoint, Role, endpoints_from_config
from pd_orchestrator.fleet.health import HealthMonitor
from pd_orchestrator.fleet.scraper import LoadScraper
from pd_orchestrator.fleet.state import FleetState
from pd_orchestrator.flows.ask_all import AskAllFlow
from pd_orchestrator.flows.decode_first import DecodeFirstFlow, FlowContext, FlowOutcome
from pd_orchestrator.flows.request import ClientRequest
from pd_orchestrator.flows.sink import ClientSink, GatewayError
from pd_orchestrator.gateway.response import FlowResponse
from pd_orchestrator.openai.errors import error_body
from pd_orchestrator.openai.protocol import (
    OpenAIRequest,
    RequestError,
    decode_json_object,
    parse_for,
)
from pd_orchestrator.openai.responses import Kind
from pd_orchestrator.planner.plan import NoCandidateError, Plan, Planner
from pd_orchestrator.policies import (
    LatencyObservation,
    ThresholdContext,
    ThresholdDecision,
    ThresholdResolver,
    build_threshold,
)
from pd_orchestrator.prefix.runtime import PrefixFields, PrefixRuntime
from pd_orchestrator.routing.profiles import build_profiles
from pd_orchestrator.routing.registry import RoutingConfigError
from pd_orchestrator.routing.types import Candidate
from pd_orchestrator.telemetry.metrics import GatewayMetrics
from pd_orchestrator.upstream.client import Upstream

__all__ = [
    "Gateway",
    "GatewayState",
    "ReloadResult",
    "build_state",
    "check_plugins",
    "status_document",
]

logger = logging.getLogger("pd_orchestrator.gateway")

_ROUTES: dict[str, Kind] = {"/v1/completions": "completion", "/v1/chat/completions": "chat"}


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, param=param), status)


@dataclass(frozen=True, slots=True)
class ReloadResult:
    """Whether a reload took effect, and what to tell the operator."""

    applied: bool
    message: str


def _restart_notes(old: GatewayConfig, new: GatewayConfig) -> str:
    changed = [k for k in ("upstream", "timeouts") if getattr(old, k) != getattr(new, k)]
    return f"{', '.join(changed)} changes take effect at restart" if changed else ""


def status_document(state: GatewayState, now: float) -> dict[str, Any]:
    """``GET /status``: the fleet by endpoint name (never URLs) with health and load."""
    endpoints = []
    for status in state.fleet.snapshot():
        endpoint = status.endpoint
        load = state.scraper.snapshot(endpoint.name, now)
        endpoints.append(
            {
                "name": endpoint.name,
                "pool": endpoint.pool,
                "role": endpoint.role.value,
                "hardware": endpoint.hardware,
                "group": endpoint.group,
                "healthy": status.healthy and state.scraper.is_responsive(endpoint.name),
                "in_flight": status.in_flight,
                "load": None
                if load is None
                else {
                    "running": load.running,
                    "waiting": load.waiting,
                    "kv_usage": load.kv_usage,
                    "prefix_hit_rate": load.prefix_hit_rate,
                    "age": round(load.age(now), 3),
                },
            }
        )
    report = state.prefix.report([state.planner.profiles.decode, state.planner.profiles.prefill])
    prefix = {
        "plugin_memory_bytes": dict(report.plugin_memory),
        "kv_event_streams": dict(report.streams),
        "index": None if report.index is None else _plain(report.index),
    }
    return {"mode": state.config.mode, "endpoints": endpoints, "prefix": prefix}


def _plain(value: Any) -> Any:
    """A dataclass of plain values as a dict (for JSON)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return str(value)


@dataclass(frozen=True)
class GatewayState:
    """Everything built from one configuration; swapped whole on reload."""

    config: GatewayConfig
    fleet: FleetState
    threshold: ThresholdResolver
    planner: Planner
    prefix: PrefixRuntime
    health: HealthMonitor
    scraper: LoadScraper
    allowed_prefillers: frozenset[str]


def check_plugins(config: GatewayConfig) -> None:
    """Build the routing profiles and the threshold policies of ``config`` once, so
    that an unknown plugin or a bad parameter is reported (``RoutingConfigError``)."""
    registry = PrefixRuntime(config.prefix, []).registry()
    build_profiles(config.routing, registry)
    build_threshold(config.threshold, registry, pools={pool.name for pool in config.pools})


def build_state(
    config: GatewayConfig,
    upstream: Upstream,
    clock: Callable[[], float],
    previous: GatewayState | None = None,
) -> GatewayState:
    """Build the state of ``config``; raises ``RoutingConfigError`` on bad plugins
    (policy errors are ``RoutingConfigError`` too).

    Endpoints that keep their name and URL across a reload keep their health.
    """
    endpoints = endpoints_from_config(config)
    fleet = FleetState(endpoints, config.health.unhealthy_after)
    if previous is not None:
        fleet.inherit(previous.fleet)
    pairs = frozenset((p.prefill_group, p.decode_group) for p in config.compatibility.host_staged)
    prefix = PrefixRuntime(config.prefix, endpoints)
    registry = prefix.registry()
    return GatewayState(
        config=config,
        fleet=fleet,
        threshold=build_threshold(
            config.threshold, registry, pools={pool.name for pool in config.pools}
        ),
        planner=Planner(build_profiles(config.routing, registry), pairs),
        prefix=prefix,
        health=HealthMonitor(fleet, upstream, config.health),
        scraper=LoadScraper(fleet, upstream, config.load, clock=clock),
        allowed_prefillers=frozenset(v.lower() for v in config.sidecar.allowed_prefillers),
    )


class Gateway:
    """One gateway instance: its state (config, fleet, planner), upstream client, metrics.

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
        transport: httpx.AsyncBaseTransport | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.clock = clock
        self.config_path = config_path
        self.metrics = GatewayMetrics()
        self.upstream = Upstream(config.upstream, config.timeouts, transport=transport)
        self.state = build_state(config, self.upstream, clock)
        self._connectors: dict[str, Connector] = {}
        self._sequence = itertools.count()
        self._monitors: anyio.CancelScope | None = None
        self._tasks: TaskGroup | None = None
        self._reload_lock = anyio.Lock()

    @property
    def config(self) -> GatewayConfig:
        return self.state.config

    @property
    def fleet(self) -> FleetState:
        return self.state.fleet

    @property
    def scraper(self) -> LoadScraper:
        return self.state.scraper

    # -- application --------------------------------------------------------------------
    def app(self) -> Starlette:
        routes = [
            Route("/v1/completions", self._completion_endpoint, methods=["POST"]),
            Route("/v1/chat/completions", self._completion_endpoint, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health_endpoint, methods=["GET"]),
            Route("/ready", self.ready, methods=["GET"]),
            Route("/metrics", self.metrics_endpoint, methods=["GET"]),
            Route("/status", self.status_endpoint, methods=["GET"]),
            Route("/admin/reload", self.admin_reload, methods=["POST"]),
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
                state = build_state(config, self.upstream, self.clock, self.state)
            except (ConfigError, RoutingConfigError, ValueError) as exc:
                self.metrics.reloads.labels("refused").inc()
                return ReloadResult(False, f"refused, the old configuration stays: {exc}")
            notes = _restart_notes(self.config, config)
            self.state = state
            if self._tasks is not None:
                await self._start_monitors(state)
            self.metrics.reloads.labels("applied").inc()
            return ReloadResult(True, "applied" + (f" ({notes})" if notes else ""))

    # -- simple routes ---------------------------------------------------------------------
    async def health_endpoint(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def ready(self, request: Request) -> Response:
        ready = self.fleet.checked_once and self.fleet.any_decoder_healthy()
        healthy = [s.endpoint.name for s in self.fleet.snapshot(Role.DECODE) if s.healthy]
        body = {"ready": ready, "healthy_decoders": healthy}
        return JSONResponse(body, 200 if ready else 503)

    async def metrics_endpoint(self, request: Request) -> Response:
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def status_endpoint(self, request: Request) -> Response:
        """Endpoints (by name) with health, in-flight requests and their latest load."""
        return JSONResponse(status_document(self.state, self.clock()))

    async def admin_reload(self, request: Request) -> Response:
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

    async def models(self, request: Request) -> Response:
        now = int(time.time())
        data = [
            {"id": name, "object": "model", "created": now, "owned_by": "pd-orchestrator"}
            for name in self.config.models()
        ]
        return JSONResponse({"object": "list", "data": data})

    # -- completions ------------------------------------------------------------------------
    async def _completion_endpoint(self, request: Request) -> Response:
        path = request.url.path
        try:
            client_request, header_prefillers = await self._admit(request, _ROUTES[path])
            fields = await self._prefix_fields(client_request)
            plan = self._plan(client_request, fields)
        except GatewayError as exc:
            self.metrics.requests.labels(path, "error", str(exc.status)).inc()
            return _error(exc.status, exc.message, exc.param)
        context = self.flow_context(client_request, header_prefillers, plan, fields)
        flow: DecodeFirstFlow
        if self.config.mode == "ask-all":
            flow = AskAllFlow(context, client_request, plan)
        else:
            flow = DecodeFirstFlow(context, client_request, plan)
        return _RunFlow(self, client_request, flow)  # type: ignore[return-value]

    async def _admit(
        self, request: Request, kind: Kind
    ) -> tuple[ClientRequest, tuple[Endpoint, ...] | None]:
        body = await _json_body(request)
        view = _parse(kind, body)
        self._check_model(view)
        header_prefillers = self._header_prefillers(request)
        client_request = ClientRequest(
            kind=kind,
            path=request.url.path,
            body=body,
            view=view,
            request_id=request.headers.get("x-request-id") or uuid.uuid4().hex,
            arrival=self.clock(),
        )
        return client_request, header_prefillers

    def _check_model(self, view: OpenAIRequest) -> None:
        served = self.config.models()
        if served and view.model not in served:
            raise GatewayError(404, f"The model `{view.model}` does not exist.", "model")

    def _header_prefillers(self, request: Request) -> tuple[Endpoint, ...] | None:
        """The sidecar header's prefillers (allow-listed), or None without the header."""
        sidecar = self.config.sidecar
        header = request.headers.get(sidecar.prefiller_header) if sidecar.enabled else None
        if header is None:
            return None
        chosen = []
        for item in (part.strip().lower() for part in header.split(",")):
            if not item:
                continue
            if item not in self.state.allowed_prefillers:
                raise GatewayError(403, f"prefiller {item!r} is not in the allow-list")
            chosen.append(self._prefiller_endpoint(item))
        if not chosen:
            raise GatewayError(400, f"header {sidecar.prefiller_header} names no prefiller")
        return tuple(chosen)

    def _prefiller_endpoint(self, host_port: str) -> Endpoint:
        for endpoint in self.fleet.endpoints(Role.PREFILL):
            if endpoint.host_port == host_port:
                return endpoint
        decoder = self.fleet.endpoints(Role.DECODE)[0]
        return Endpoint(
            name=host_port,
            url=f"http://{host_port}",
            role=Role.PREFILL,
            group=decoder.group,
            connector=decoder.connector,
        )

    # -- planning -----------------------------------------------------------------------------
    def candidates(self) -> tuple[Candidate, ...]:
        """Every endpoint with its health, in-flight count and fresh load reading."""
        return self.scraper.candidates(self.fleet.snapshot(), self.clock())

    async def _prefix_fields(self, request: ClientRequest) -> PrefixFields:
        """The request's prompt, token ids, LoRA and salt for the prefix scorers."""
        state = self.state
        chat = request.kind == "chat"
        fields = state.prefix.request_fields(request.body, chat=chat)
        decoders = [c.endpoint for c in self.candidates() if c.healthy and c.endpoint.role.decodes]
        if decoders:
            fields = await state.prefix.tokenized(
                fields, request.body, chat=chat, upstream=self.upstream, endpoint=decoders[0]
            )
        return fields

    def _plan(self, request: ClientRequest, fields: PrefixFields | None = None) -> Plan:
        state = self.state
        candidates = self.candidates()
        now = self.clock()
        chars = request.prompt_chars
        tokens = state.threshold.estimate_tokens(request.model, chars)
        by_name = {c.endpoint.name: c for c in candidates}

        def threshold(decoder: Candidate) -> ThresholdDecision:
            prefillers = state.planner.prefillers(
                request, decoder.endpoint, candidates, now, next(self._sequence), fields
            )
            context = ThresholdContext(
                model=request.model,
                decoder=decoder,
                prompt_tokens=tokens,
                prompt_chars=chars,
                prefillers=tuple(by_name[p.name] for p in prefillers if p.name in by_name),
                client_threshold=request.view.cache_hit_threshold,
                now=now,
            )
            return state.threshold.decide(context)

        try:
            plan = state.planner.plan(
                request, candidates, now, next(self._sequence), threshold, fields
            )
        except NoCandidateError as exc:
            raise GatewayError(503, str(exc)) from None
        self.metrics.record_threshold(plan.threshold)
        return plan

    def flow_context(
        self,
        request: ClientRequest,
        header_prefillers: tuple[Endpoint, ...] | None,
        plan: Plan,
        fields: PrefixFields | None = None,
    ) -> FlowContext:
        """The request's view of the gateway: one state for its whole life."""
        state = self.state

        def candidates() -> tuple[Candidate, ...]:
            return state.scraper.candidates(state.fleet.snapshot(), self.clock())

        def prefillers_for(decoder: Endpoint) -> tuple[Endpoint, ...]:
            if header_prefillers is not None:
                return header_prefillers
            return state.planner.prefillers(
                request, decoder, candidates(), self.clock(), next(self._sequence), fields
            )

        def pick_decoder() -> Endpoint:
            ranking = state.planner.rank(
                request, candidates(), self.clock(), next(self._sequence), fields
            )
            if ranking.pick is None:
                raise GatewayError(503, "no decoder can continue this request")
            return ranking.pick.endpoint

        def observe(outcome: FlowOutcome) -> None:
            pool = outcome.decoder.pool
            now = self.clock()
            state.threshold.observe(
                LatencyObservation(request.model, pool, now, ttft=outcome.ttft, itl=outcome.itl)
            )
            if outcome.prompt_tokens:
                state.threshold.observe_usage(
                    request.model, request.prompt_chars, outcome.prompt_tokens
                )

        def routed(decoder: Endpoint) -> None:
            state.planner.routed(plan, decoder)

        return FlowContext(
            upstream=self.upstream,
            config=state.config,
            fleet=state.fleet,
            metrics=self.metrics,
            prefillers_for=prefillers_for,
            pick_decoder=pick_decoder,
            connector_for=self.connector_for,
            candidates=candidates,
            observe=observe,
            routed=routed,
            clock=self.clock,
        )

    def connector_for(self, endpoint: Endpoint) -> Connector:
        """The connector adapter an endpoint's pool uses (one instance per name)."""
        connector = self._connectors.get(endpoint.connector)
        if connector is None:
            connector = self._connectors[endpoint.connector] = get_connector(endpoint.connector)
        return connector


class _RunFlow:
    """The ASGI response of one completion request."""

    def __init__(self, gateway: Gateway, request: ClientRequest, flow: DecodeFirstFlow) -> None:
        self.gateway = gateway
        self.request = request
        self.flow = flow

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        metrics = self.gateway.metrics
        metrics.in_flight.inc()
        response = FlowResponse(self._run, self._done, self.flow.headers)
        try:
            await response(scope, receive, send)
        finally:
            metrics.in_flight.dec()

    async def _run(self, sink: ClientSink) -> None:
        await self.flow.run(sink)

    def _done(self, status: int, error: Exception | None) -> None:
        decision = "error" if error is not None or status >= 400 else self.flow.decision
        metrics = self.gateway.metrics
        metrics.requests.labels(self.request.path, decision, str(status)).inc()
        if decision != "error":
            metrics.decisions.labels(decision).inc()


async def _json_body(request: Request) -> dict[str, Any]:
    try:
        return decode_json_object(await request.body())
    except RequestError as exc:
        raise GatewayError(400, str(exc)) from None


def _parse(kind: Kind, body: dict[str, Any]) -> OpenAIRequest:
    try:
        return parse_for(kind, body)
    except RequestError as exc:
        raise GatewayError(400, str(exc), exc.param) from None
