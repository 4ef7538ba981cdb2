"""The gateway's ASGI application.

Routes: ``POST /v1/completions`` and ``POST /v1/chat/completions`` (JSON or SSE),
``GET /v1/models``, ``GET /health`` (the process is up), ``GET /ready`` (200 once
a decoder passed a health check), ``GET /metrics``.

A completion request is parsed once into a typed view (bad input: 400 in vLLM's
error shape), checked against the served models (404) and, in sidecar mode,
against the prefiller allow-list (403); then planned (pure) and served by the
decode-first flow.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import httpx
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from connectors import get_connector
from pd_orchestrator.config.settings import GatewayConfig
from pd_orchestrator.fleet.endpoints import Endpoint, Role, endpoints_from_config
from pd_orchestrator.fleet.health import HealthMonitor
from pd_orchestrator.fleet.state import EndpointStatus, FleetState
from pd_orchestrator.flows.decode_first import DecodeFirstFlow, FlowContext
from pd_orchestrator.flows.request import ClientRequest
from pd_orchestrator.flows.sink import ClientSink, GatewayError
from pd_orchestrator.gateway.response import FlowResponse
from pd_orchestrator.openai.errors import error_body
from pd_orchestrator.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    OpenAIRequest,
    RequestError,
    parse_request,
)
from pd_orchestrator.openai.responses import Kind
from pd_orchestrator.planner.decode_first import Plan, order_candidates, plan_decode_first
from pd_orchestrator.policies import ThresholdContext, ThresholdDecision, build_threshold
from pd_orchestrator.routing import Candidate, builtin_registry
from pd_orchestrator.telemetry.metrics import GatewayMetrics
from pd_orchestrator.upstream.client import Upstream

__all__ = ["Gateway"]

_ROUTES: dict[str, Kind] = {"/v1/completions": "completion", "/v1/chat/completions": "chat"}


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, param=param), status)


class Gateway:
    """One gateway instance: configuration, fleet state, upstream client, metrics."""

    def __init__(
        self,
        config: GatewayConfig,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.clock = clock
        self.fleet = FleetState(endpoints_from_config(config), config.health.unhealthy_after)
        self.metrics = GatewayMetrics()
        self.connector = get_connector(config.connector)
        pools = {pool.name for pool in config.pools}
        self.threshold = build_threshold(config.threshold, builtin_registry(), pools=pools)
        self.upstream = Upstream(config.upstream, config.timeouts, transport=transport)
        self.health = HealthMonitor(self.fleet, self.upstream, config.health)
        self._turns = itertools.count()
        self._allowed = {value.lower() for value in config.sidecar.allowed_prefillers}

    # -- application --------------------------------------------------------------------
    def app(self) -> Starlette:
        routes = [
            Route("/v1/completions", self._completion_endpoint, methods=["POST"]),
            Route("/v1/chat/completions", self._completion_endpoint, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health_endpoint, methods=["GET"]),
            Route("/ready", self.ready, methods=["GET"]),
            Route("/metrics", self.metrics_endpoint, methods=["GET"]),
        ]
        return Starlette(routes=routes, lifespan=self._lifespan)

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        async with anyio.create_task_group() as tg:
            await tg.start(self.health.run)
            try:
                yield
            finally:
                tg.cancel_scope.cancel()
                with anyio.move_on_after(2, shield=True):
                    await self.upstream.aclose()

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
            client_request, prefillers = await self._admit(request, _ROUTES[path])
        except GatewayError as exc:
            self.metrics.requests.labels(path, "error", str(exc.status)).inc()
            return _error(exc.status, exc.message, exc.param)
        plan = self._plan(client_request, prefillers)
        return _RunFlow(self, client_request, plan)  # type: ignore[return-value]

    async def _admit(self, request: Request, kind: Kind) -> tuple[ClientRequest, list[Endpoint]]:
        body = await _json_body(request)
        view = _parse(kind, body)
        self._check_model(view)
        prefillers = self._prefillers_for(request)
        client_request = ClientRequest(
            kind=kind,
            path=request.url.path,
            body=body,
            view=view,
            request_id=request.headers.get("x-request-id") or uuid.uuid4().hex,
            arrival=self.clock(),
        )
        return client_request, prefillers

    def _check_model(self, view: OpenAIRequest) -> None:
        served = self.config.models()
        if served and view.model not in served:
            raise GatewayError(404, f"The model `{view.model}` does not exist.", "model")

    def _prefillers_for(self, request: Request) -> list[Endpoint]:
        sidecar = self.config.sidecar
        header = request.headers.get(sidecar.prefiller_header) if sidecar.enabled else None
        if header is None:
            return self.fleet.endpoints(Role.PREFILL)
        chosen = []
        for item in (part.strip().lower() for part in header.split(",")):
            if not item:
                continue
            if item not in self._allowed:
                raise GatewayError(403, f"prefiller {item!r} is not in the allow-list")
            chosen.append(self._prefiller_endpoint(item))
        if not chosen:
            raise GatewayError(400, f"header {sidecar.prefiller_header} names no prefiller")
        return chosen

    def _prefiller_endpoint(self, host_port: str) -> Endpoint:
        for endpoint in self.fleet.endpoints(Role.PREFILL):
            if endpoint.host_port == host_port:
                return endpoint
        return Endpoint(name=host_port, url=f"http://{host_port}", role=Role.PREFILL)

    def _plan(self, request: ClientRequest, prefillers: list[Endpoint]) -> Plan:
        configured = {s.endpoint.name: s for s in self.fleet.snapshot(Role.PREFILL)}
        statuses = [configured.get(e.name) or EndpointStatus(e, True, 0) for e in prefillers]

        chars = request.prompt_chars

        def threshold(decoder: EndpointStatus) -> ThresholdDecision:
            context = ThresholdContext(
                model=request.model,
                decoder=Candidate.from_status(decoder),
                prompt_tokens=self.threshold.estimate_tokens(request.model, chars),
                prompt_chars=chars,
                prefillers=tuple(Candidate.from_status(s) for s in statuses),
                client_threshold=request.view.cache_hit_threshold,
                now=self.clock(),
            )
            return self.threshold.decide(context)

        plan = plan_decode_first(
            self.fleet.snapshot(Role.DECODE),
            statuses,
            next(self._turns),
            threshold,
            affinity_key=request.affinity_key(),
        )
        self.metrics.record_threshold(plan.threshold)
        return plan

    def pick_decoder(self) -> Endpoint:
        """The decoder a continuation should use now (healthiest, least loaded)."""
        return order_candidates(self.fleet.snapshot(Role.DECODE), next(self._turns))[0].endpoint

    def flow_context(self) -> FlowContext:
        return FlowContext(
            upstream=self.upstream,
            connector=self.connector,
            config=self.config,
            fleet=self.fleet,
            metrics=self.metrics,
            pick_decoder=self.pick_decoder,
            clock=self.clock,
        )


class _RunFlow:
    """The ASGI response of one completion request."""

    def __init__(self, gateway: Gateway, request: ClientRequest, plan: Plan) -> None:
        self.gateway = gateway
        self.request = request
        self.flow = DecodeFirstFlow(gateway.flow_context(), request, plan)

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
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise GatewayError(400, f"malformed JSON body: {exc}") from None
    if not isinstance(body, dict):
        raise GatewayError(400, "the request body must be a JSON object")
    return body


def _parse(kind: Kind, body: dict[str, Any]) -> OpenAIRequest:
    try:
        if kind == "completion":
            return parse_request(CompletionRequest, body)
        return parse_request(ChatCompletionRequest, body)
    except RequestError as exc:
        raise GatewayError(400, str(exc), exc.param) from None
