"""The completion path: one ``POST /v1/completions`` or ``/v1/chat/completions``,
top to bottom (the gateway's routes dispatch to it; see :mod:`~pd_orchestrator.gateway.app`).

1. admission (:mod:`~pd_orchestrator.gateway.admission`): read, parse once, check;
2. the planner (pure): the whole plan over a snapshot of the fleet;
3. the flow, through the request's legs, into the client's renderer
   (:func:`~pd_orchestrator.gateway.response.respond` watches for a disconnect);
4. the planner learns from the flow's outcome after it returned (metrics, the
   learning plugins, threshold feedback, the adaptive width);
5. after the answer ended: the request's span and access-log line, when tracing or
   the access log is on (:mod:`~pd_orchestrator.gateway.observe`).

A request runs on the gateway state it came with: a reload swaps the gateway's state
for new requests only.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from dataclasses import replace
from functools import partial

from starlette.types import Receive, Scope, Send

from pd_orchestrator.flows.bodies import SharedEncoding
from pd_orchestrator.flows.choices import choice_request, run_choices
from pd_orchestrator.flows.flow import Flow, Outcome
from pd_orchestrator.flows.legs import Legs
from pd_orchestrator.flows.render import renderer_for
from pd_orchestrator.flows.request import ClientRequest
from pd_orchestrator.flows.sink import ClientSink, GatewayError
from pd_orchestrator.gateway.admission import Admitted, RequestIds, admit, header_map, read_json
from pd_orchestrator.gateway.auth import forwarded_headers
from pd_orchestrator.gateway.lifecycle import SHUTTING_DOWN, Drain
from pd_orchestrator.gateway.observe import Answered, log_access, span_attributes
from pd_orchestrator.gateway.protocol import default_concurrent_choices
from pd_orchestrator.gateway.response import disconnects_of, error_of, refuse, respond
from pd_orchestrator.gateway.state import GatewayState
from pd_orchestrator.model.load import Candidate
from pd_orchestrator.openai.responses import Kind
from pd_orchestrator.planner.plan import NoCandidateError, Plan, Served
from pd_orchestrator.telemetry.logs import REQUEST_ID
from pd_orchestrator.telemetry.metrics import GatewayMetrics
from pd_orchestrator.telemetry.tracing import RequestTrace, Tracing
from pd_orchestrator.upstream.client import Upstream

__all__ = ["CompletionPath"]

logger = logging.getLogger("pd_orchestrator.gateway")


class CompletionPath:
    """Serves completion requests (see the module docstring) with the gateway's
    upstream client, metrics, clock, tracer, drain and request ids."""

    def __init__(
        self,
        upstream: Upstream,
        metrics: GatewayMetrics,
        clock: Callable[[], float],
        tracing: Tracing | None,
        drain: Drain,
        ids: RequestIds,
    ) -> None:
        self.upstream = upstream
        self.metrics = metrics
        self.clock = clock
        self.tracing = tracing
        self.drain = drain
        self._ids = ids
        self._ordinals = itertools.count()
        self._concurrent_choices = default_concurrent_choices()
        self._told: set[str] = set()
        """Decoders named in the log as taking no admission-only threshold."""

    async def serve(
        self, state: GatewayState, own_keys: bool, scope: Scope, receive: Receive, send: Send,
        kind: Kind,
    ) -> None:  # fmt: skip
        """One completion request on ``state`` (the gateway's configuration when it came),
        top to bottom (see the module docstring); ``own_keys``: the gateway checks client
        keys of its own (they are not forwarded)."""
        drain = self.drain
        drain.requests += 1
        try:
            await self._complete(state, own_keys, scope, receive, send, kind)
        finally:
            drain.requests -= 1

    async def _complete(
        self, state: GatewayState, own_keys: bool, scope: Scope, receive: Receive, send: Send,
        kind: Kind,
    ) -> None:  # fmt: skip
        path = scope["path"]
        started = self.clock()
        headers = header_map(scope["headers"])
        tracing = self.tracing
        trace = None if tracing is None else tracing.request("POST", path, headers)
        try:
            admitted, plan = await self._plan(state, headers, receive, kind, path)
            if self.drain.closing:
                raise GatewayError(503, SHUTTING_DOWN)
        except Exception as exc:
            status, message, param = error_of(exc)
            self.metrics.count_request(path, "error", status)
            if status != 499:
                await refuse(send, GatewayError(status, message, param))
            self.observe(state, trace, Answered("POST", path, status, None, message), started)
            return
        forward = forwarded_headers(headers, own_keys=own_keys, tracing=trace)
        flows = self._flows(state, admitted.request, plan, forward, trace)
        flow = flows[0]
        limits = state.config.limits
        concurrency = limits.max_concurrent_choices or self._concurrent_choices
        serve = (
            partial(self._run, flow)
            if len(flows) == 1
            else partial(self._choices, flows, concurrency)
        )
        self.metrics.in_flight.inc()
        try:
            pending = await respond(
                receive, send, serve, flow.headers, self.drain.scopes, disconnects_of(scope)
            )
            self._learn(state, admitted, plan, pending.result)
            status = await pending.finish()
        finally:
            self.metrics.in_flight.dec()
        self._count(path, pending.result, status)
        if trace is not None or state.config.logging.access_log:
            error = None if pending.error is None else str(pending.error)
            self.observe(state, trace, Answered("POST", path, status, flow, error), started)

    def observe(
        self, state: GatewayState, trace: RequestTrace | None, answered: Answered, started: float
    ) -> None:
        """After the answer ended: end the request's span, write its access-log line."""
        if trace is not None:
            trace.finish(answered.status, span_attributes(answered), answered.error)
        if state.config.logging.access_log:
            log_access(answered, self.clock() - started)

    async def _plan(
        self, state: GatewayState, headers: dict[str, str], receive: Receive, kind: Kind, path: str
    ) -> tuple[Admitted, Plan]:
        body = await read_json(receive, state.config.limits, kind)
        now = self.clock()
        admitted = admit(state, kind, path, body, headers, now, self._ids)
        REQUEST_ID.set(admitted.request.request_id)
        candidates = state.scraper.current(now)
        admitted = await self._tokenized(state, admitted, candidates)
        try:
            plan = state.planner.plan(admitted.facts, candidates, now, next(self._ordinals))
        except NoCandidateError as exc:
            raise GatewayError(503, str(exc)) from None
        self.metrics.record_threshold(plan.route)
        if not admitted.facts.continuable:
            self._constrained(plan, candidates)
        return admitted, plan

    def _constrained(self, plan: Plan, candidates: tuple[Candidate, ...]) -> None:
        """Count a constrained request by how its threshold went; name once each decoder
        that made it zero (its plugin takes no admission-only)."""
        if plan.continuable:
            self.metrics.constrained.labels("resumable").inc()
            return
        admission_only = plan.route.admission_only
        self.metrics.constrained.labels("admission-only" if admission_only else "zero").inc()
        if admission_only:
            return
        for candidate in candidates:
            name = candidate.endpoint.name
            if not candidate.endpoint.role.decodes or name in self._told:
                continue
            if candidate.load is not None and not candidate.admission_only:
                self._told.add(name)
                logger.warning(
                    "decoder %s does not take cache_hit_admission_only (an older threshold "
                    "plugin): requests with tools, structured outputs or logprobs that may "
                    "go to it are sent with threshold 0",
                    name,
                )

    async def _tokenized(
        self, state: GatewayState, admitted: Admitted, candidates: tuple[Candidate, ...]
    ) -> Admitted:
        """``admitted`` with the prompt's token ids from a decoder, when the precise
        prefix index wants them (``prefix.precise.tokenize``), in its facts and its
        request."""
        facts = admitted.facts
        if not state.prefix.needs_tokens(facts.fields):
            return admitted
        decoders = [c.endpoint for c in candidates if c.healthy and c.endpoint.role.decodes]
        if not decoders:
            return admitted
        request = admitted.request
        rid = f"{request.request_id}-tokenize"  # its own leg ids: the flow counts from -1
        legs = Legs(self.upstream, state.fleet, self.metrics, rid, self.clock)
        fields = await state.prefix.tokenized(
            facts.fields, request.body, chat=request.kind == "chat", legs=legs,
            endpoint=decoders[0],
        )  # fmt: skip
        if fields.token_ids is not None:  # the flow may send them (ask-all: tokenize once)
            request = replace(request, prompt_ids=fields.token_ids)
        return Admitted(request, replace(facts, fields=fields))

    def _flows(
        self,
        state: GatewayState,
        request: ClientRequest,
        plan: Plan,
        forward: dict[str, str] | None,
        trace: RequestTrace | None,
    ) -> list[Flow]:
        """The request's flow; one per choice when it asks for ``n`` > 1. Every leg of
        every choice carries ``forward`` and, when tracing, hangs below ``trace``; the
        body's large values are encoded once for all of them."""
        requests = [request]
        if request.view.n > 1:
            requests = [choice_request(request, i) for i in range(request.view.n)]
        encoding = SharedEncoding(request.body)  # the prompt's bytes once for every leg
        upstream, fleet, metrics, clock = self.upstream, state.fleet, self.metrics, self.clock
        return [
            Flow(
                one,
                plan,
                Legs(
                    upstream,
                    fleet,
                    metrics,
                    one.request_id,
                    clock,
                    forward=forward,
                    trace=trace,
                    encoding=encoding,
                ),
                state.attempt,
                state.flow,
            )
            for one in requests
        ]

    async def _run(self, flow: Flow, sink: ClientSink) -> Outcome:
        renderer = renderer_for(flow.request, flow.transcript, sink, self.clock)
        return await flow.run(renderer)

    async def _choices(self, flows: list[Flow], concurrency: int, sink: ClientSink) -> Outcome:
        return await run_choices(flows, flows[0].request, sink, self.clock, concurrency)

    def _learn(
        self, state: GatewayState, admitted: Admitted, plan: Plan, outcome: Outcome | None
    ) -> None:
        """After the flow, before its answer ends: teach the planner what it did."""
        if outcome is None:
            return
        cached = outcome.cached_tokens
        if outcome.decision != "pd":  # the original prompt's count came from the decoder
            cached = state.cache_reports.resolve(outcome.decoder.name, cached)
        served = Served(
            outcome.decoder,
            self.clock(),
            outcome.ttft,
            outcome.itl,
            outcome.prompt_tokens,
            cached_tokens=cached,
            output_tokens=outcome.output_tokens,
            remote=outcome.decision == "pd",
            rejected=outcome.rejected,
            after_prefill=outcome.after_prefill,
            prefiller=outcome.prefiller,
            prefill_cached=outcome.prefill_cached,
            prefill_seconds=outcome.prefill_seconds,
        )
        try:
            state.planner.learn(plan, admitted.facts, served)
        except Exception:  # a learning plugin's fault must not fail a served request
            logger.exception("learning from a served request failed")

    def _count(self, path: str, outcome: Outcome | None, status: int) -> None:
        """Count one answered request by route, decision and status."""
        decision = "error" if outcome is None or status >= 400 else outcome.decision
        self.metrics.count_request(path, decision, status)
        if decision != "error" and outcome is not None:
            if outcome.ttft is not None:
                self.metrics.ttft.observe(outcome.ttft)
            if outcome.itl is not None:
                self.metrics.itl.observe(outcome.itl)
