"""The flow: ask the decoder first, prefill elsewhere only when it says so.

One client request, from its plan to the last byte the client gets:

1. **Attempt** (:mod:`~pd_orchestrator.flows.attempts`): the client's request goes
   to the plan's decoder(s) with the policy's ``cache_hit_threshold`` and
   ``return_token_ids``, read up to its first decisive chunk (the first that carries
   content or a finish). When the attempt tokenizes once (ask-all), the original
   prompt's legs, here and in steps 2-3, carry its token ids on ``/v1/completions``.
2. **Admitted**: that decoder's leg serves. Decision ``decode``.
3. **Rejected** (``finish_reason == "cache_threshold"`` with no token, or a stream
   that ends with no choice): the P/D leg (:mod:`~pd_orchestrator.flows.handover`)
   -- prefill on a prefiller compatible with the decoder, the KV handed over as the
   decoder's connector says (legs in sequence or together), the decode leg with
   threshold 0; retried on other prefillers when the prefill side fails. A prefill
   that returns no params but finished is itself the answer. Decision ``pd``.
   (Ask-all's ``local`` fallback: the decoder serves with threshold 0.)
4. **Relay**: every leg is read and relayed the same way, whole answers as one
   batch and streams batch by batch, into the client's renderer
   (:mod:`~pd_orchestrator.flows.render`), which writes SSE or one JSON answer. The
   response starts (status, ``x-pd-*`` headers) once the serving leg's first
   decisive chunk is in, so the headers are truthful.
5. **Hand-back** (``cache_threshold`` after tokens: the decoder preempted the
   request): prompt ids plus every generated id go back through the same P/D leg as
   a token prompt on ``/v1/completions`` with ``max_tokens`` reduced and
   ``handback.leg_threshold`` (a structured output or named tool with its constraint
   and ``cache_hit_resume_tokens``, logprobs asked as completions asks them:
   :func:`~pd_orchestrator.flows.bodies.continuation_body`); after
   ``handback.max_handbacks`` hand-backs, straight to a decoder with threshold 0.
   Only a plan that is :attr:`~pd_orchestrator.planner.plan.Plan.continuable` is
   continued (a hand-back or a recovery).
6. **Outcome**: :meth:`Flow.run` returns what happened (:class:`Outcome`); the
   gateway learns from it. Nothing here calls back into the gateway or the planner.

Every decision above and below is the sans-I/O :class:`~pd_orchestrator.flows.machine.FlowMachine`'s
(the virtual bench drives the same machine); :class:`Flow` carries its steps out with
real legs.

Faults (a failure is *retryable* when the connection was refused or broke, a
timeout elapsed, or the endpoint answered 5xx; a 4xx is the request's own and is
answered as such):

* **Before the first byte reached the client**, steps 1-3 start over on the plan's
  next decoder not seen failing in this request, for a retryable failure of a
  decoder leg (the attempt, or the decode leg of a hand-over), up to
  ``upstream.decode_attempts`` decoders. Held chunks were never relayed, so nothing
  is lost or repeated; a whole answer is not sent before it is complete, so this
  covers a decoder that dies in the middle of one.
* **Prefill side**: the hand-over retries across prefillers itself; when it still
  fails, ``upstream.prefill_fallback: local`` (the default) sends the request to the
  decoder with threshold 0, which prefills it on its own.
* **Mid-answer** (a leg that fails after content reached the client, or a
  continuation that cannot start): the request continues as in step 5, prompt plus
  every token the client got, on the best decoder not seen failing, at most
  ``handback.max_recoveries`` times. When none of the plan's is left, a decoder that
  is out of routing only because a leg broke on it (not for failed health checks,
  not ejected) is still tried: the request's own outcome decides, as in panic
  routing.
* Otherwise the failure is the answer: one error (:mod:`~pd_orchestrator.upstream.errors`).

An answer that is not what vLLM sends is the endpoint's protocol error, handled as a
broken leg (and counted against it by outlier detection): a field of the wrong type,
content after the finish reason (the chunk with the finish is held until the leg
ends, so none of the faulty part reaches the client), more tokens than the request
allows, no finish reason, or ``cache_threshold`` from a leg sent with threshold 0
(vLLM rejects only below a threshold: every P/D decode leg and local leg is sent with
0, so a decoder that rejects them anyway fails instead of being asked forever).

Every loop is bounded: decoders tried before the first byte by
``upstream.decode_attempts``, prefill attempts per hand-over by
``upstream.prefill_attempts`` (and ``prefill_budget``), hand-backs by
``handback.max_handbacks`` (the next goes to a decoder with threshold 0, which may not
hand back), recoveries by ``handback.max_recoveries``, choices by ``n``. As a
backstop, a request that sent as many upstream requests as all of them together
allow (:func:`leg_budget`) is answered 502 rather than send another.

The client sees one id, one role chunk and one usage figure: prompt and cached tokens
of the leg that served the original prompt, completion tokens counted once each as
the client got them (the token ids of every leg, broken ones too).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from connectors import Connector
from pd_orchestrator.config.settings import HandbackConfig, UpstreamConfig
from pd_orchestrator.flows.attempts import Attempt, Single
from pd_orchestrator.flows.bodies import COMPLETIONS, Route, continuation_body, with_threshold
from pd_orchestrator.flows.chunks import CACHE_THRESHOLD, ChunkView
from pd_orchestrator.flows.handover import Handover, retryable
from pd_orchestrator.flows.legs import Leg, Legs
from pd_orchestrator.flows.machine import Alone, Done, FlowMachine, Serve, Step, ThroughPD
from pd_orchestrator.flows.render import Renderer
from pd_orchestrator.flows.request import ClientRequest
from pd_orchestrator.flows.sink import GatewayError
from pd_orchestrator.flows.transcript import Transcript
from pd_orchestrator.model.endpoints import Endpoint
from pd_orchestrator.model.records import record
from pd_orchestrator.model.route import threshold_of
from pd_orchestrator.openai.responses import Kind
from pd_orchestrator.planner.plan import Plan, after_prefill, leg_seconds
from pd_orchestrator.telemetry.metrics import GatewayMetrics
from pd_orchestrator.upstream.client import Phase
from pd_orchestrator.upstream.errors import UpstreamError

__all__ = ["COMPLETIONS", "Flow", "FlowSettings", "Outcome", "leg_budget"]

Json = dict[str, Any]
_DECODER_PHASES = frozenset({Phase.DECODE_ATTEMPT, Phase.DECODE})
logger = logging.getLogger("pd_orchestrator.flows")


def leg_budget(upstream: UpstreamConfig, handback: HandbackConfig, asked: int) -> int:
    """The most upstream requests one client request (one choice) may send, from the
    bounds above: one ``/tokenize`` (tokenize once); per decoder tried before the
    first byte, the attempt (``asked``
    decoders, plus the real request after ask-all's probes) and a hand-over; per
    hand-back (one more than ``max_handbacks``) and recovery, a hand-over. A hand-over
    sends per prefill attempt at most two lookups, the prefill and two decode legs (a
    stale connector context sends the decode leg again), then the decoder alone."""
    handover = 5 * upstream.prefill_attempts + 1
    original = 1 + upstream.decode_attempts * (asked + 1 + handover)  # 1: a /tokenize
    continuations = (handback.max_handbacks + 1 + handback.max_recoveries) * handover
    return original + continuations


@record
class FlowSettings:
    """What a flow needs of the configuration: hand-back and retry settings, the
    connector adapter of each connector name, metrics and the clock."""

    handback: HandbackConfig
    upstream: UpstreamConfig
    connectors: Mapping[str, Connector]
    metrics: GatewayMetrics
    clock: Callable[[], float]


@record
class Outcome:
    """What a served request did: its decision, the decoder that served it last, the
    prefiller (if any), the time to first token, mean ITL, prompt tokens, the prompt
    tokens the first decoder had cached (None: not reported), output tokens, the
    decoders that rejected the original prompt at its threshold and, of a P/D request,
    seconds from its prefill answer to its first content (None: unknown) and the
    prompt tokens its prefiller reported cached (None: not reported)."""

    decision: str
    decoder: Endpoint
    prefiller: Endpoint | None
    ttft: float | None
    itl: float | None
    prompt_tokens: int | None
    handbacks: int
    cached_tokens: int | None = None
    output_tokens: int = 0
    rejected: tuple[str, ...] = ()
    after_prefill: float | None = None
    prefill_cached: int | None = None
    prefill_seconds: float | None = None


class Flow:
    """Serves one client request along its plan; see the module docstring."""

    def __init__(
        self,
        request: ClientRequest,
        plan: Plan,
        legs: Legs,
        attempt: Attempt,
        settings: FlowSettings,
    ) -> None:
        self.request = request
        self.legs = legs
        self.attempt = attempt
        self.settings = settings
        self.transcript = Transcript(request)
        self.machine = FlowMachine(plan, settings.handback, settings.upstream)
        self.prefiller: Endpoint | None = None
        self.answered: float | None = None
        self.prefill_cached: int | None = None
        self.prefill_seconds: float | None = None
        self.rejected: tuple[str, ...] = ()
        self.stream_legs = request.stream or attempt.streams
        self.route: Route | None = None
        """How the original prompt's legs go (known at the first attempt)."""
        self.budget = leg_budget(settings.upstream, settings.handback, len(plan.asked))
        legs.prompt_tokens, legs.blocks = plan.prompt_tokens, plan.blocks

    @property
    def plan(self) -> Plan:
        """The request's plan (after any start-over on other decoders)."""
        return self.machine.plan

    @plan.setter
    def plan(self, plan: Plan) -> None:
        self.machine.plan = plan

    @property
    def decoder(self) -> Endpoint:
        """The decoder that serves (or continues) the request."""
        return self.machine.decoder

    @property
    def decision(self) -> str:
        """``decode`` or ``pd``: how the original prompt was served."""
        return self.machine.decision

    @property
    def recoveries(self) -> int:
        """Continuations after a leg failed mid-answer."""
        return self.machine.recoveries

    def follow(self, first: Flow) -> None:
        """Make this flow one of the other choices of ``first``'s request (choice 0,
        which began its answer, so its decoder holds the prompt): asked on that decoder
        alone as decode-first asks (:class:`~pd_orchestrator.flows.attempts.Single`:
        admitted warm, not prefilled again, whatever the mode), the prompt on the
        route ``first`` sent it (the same token ids, no second ``/tokenize``)."""
        self.plan = self.plan.following(first.decoder)
        self.machine.decoder = first.decoder
        self.attempt = Single()
        self.route = first.route

    def headers(self) -> dict[str, str]:
        """The response headers that report the decision (endpoint names only)."""
        headers = {
            "x-pd-decision": self.decision,
            "x-pd-decoder": self.decoder.name,
            "x-request-id": self.request.request_id,
        }
        if self.prefiller is not None:
            headers["x-pd-prefiller"] = self.prefiller.name
        return headers

    async def run(self, renderer: Renderer) -> Outcome:
        """Serve the request into ``renderer``; raises GatewayError/UpstreamError."""
        started = self.settings.clock()
        try:
            leg = await self._first_leg()
            await renderer.begin(self.headers())
            await self._relay_all(leg, renderer)
            await renderer.end(self.headers())
        except BaseException:  # no awaiting `finally` in a compiled module (setup.py)
            await self._ended(started)
            raise
        await self._ended(started)
        timing = renderer.timing
        transcript = self.transcript
        return Outcome(
            self.decision,
            self.decoder,
            self.prefiller,
            timing.ttft,
            timing.itl,
            transcript.prompt_tokens,
            transcript.handbacks,
            transcript.cached_tokens,
            transcript.completion_tokens,
            self.rejected,
            after_prefill(self.request.arrival, timing.ttft, self.answered),
            self.prefill_cached,
            self.prefill_seconds,
        )

    # -- the leg that serves the original prompt ------------------------------------------------
    async def _first_leg(self) -> Leg:
        """The leg that serves the original prompt, read to its first decisive chunk; on
        the plan's next decoder when one fails before the client got anything."""
        while True:
            try:
                return await self._serve_original(self.plan)
            except UpstreamError as exc:
                await self.legs.aclose()  # nothing of it reached the client
                self._start_over(exc)

    async def _serve_original(self, plan: Plan) -> Leg:
        """Steps 1-3 on ``plan``: the attempt, then P/D (or the decoder alone)."""
        self._within_budget()
        request = self.request
        started = self.settings.clock()
        self.prefiller = None
        route = self.route
        if route is None:
            ids = await self.attempt.prompt_ids(request, plan, self.legs)
            route = self.route = Route.of(request, ids)
        body = route.body(
            request, threshold_of(plan.route), stream=self.stream_legs,
            admission_only=plan.route.admission_only,
        )  # fmt: skip
        attempted = await self.attempt.run(route, plan, self.legs, body)
        self._phase("decode_attempt", started)
        self.rejected = attempted.rejected
        step = self.machine.attempted(
            attempted.decoder, admitted=attempted.leg is not None, local=attempted.local
        )
        if isinstance(step, Serve):
            assert attempted.leg is not None
            return attempted.leg
        base = route.body(request, 0.0, stream=self.stream_legs, admission_only=False)
        leg = await self._step(step, base, route.path, route.kind, original_prompt=True)
        await leg.read_until_decisive()
        return leg

    def _start_over(self, exc: UpstreamError) -> None:
        """Start over on the plan without the decoders seen failing; raises ``exc``
        unless the machine says another decoder may be tried."""
        legs, machine = self.legs, self.machine
        if not machine.may_start_over(
            retryable=retryable(exc), on_decoder=exc.phase in _DECODER_PHASES
        ):
            raise exc
        if self.prefiller is not None:
            legs.exclude(self.prefiller.name)  # its KV may be what the decode leg lacked
        if not machine.start_over(self.plan.retried(legs.failed, legs.fleet)):
            raise exc
        self.settings.metrics.count_upstream_error(exc.endpoint, "retried")

    async def _step(
        self, step: ThroughPD | Alone, body: Json, path: str, kind: Kind, *, original_prompt: bool
    ) -> Leg:
        """Carry out the machine's ``step``: the P/D leg, or the decoder alone."""
        if isinstance(step, ThroughPD):
            return await self._pd(body, path, kind, original_prompt=original_prompt)
        return await self._local(body, path, kind, original_prompt=original_prompt)

    async def _pd(self, body: Json, path: str, kind: Kind, *, original_prompt: bool) -> Leg:
        """The P/D leg to :attr:`decoder` (one leg, however reached; see
        :mod:`~pd_orchestrator.flows.handover`); when no prefiller can reach the decoder
        or the prefill side fails, what the machine says (the decoder alone, or the
        error)."""
        decoder = self.decoder
        prefillers = self.plan.prefillers_for(decoder)
        settings = self.settings
        if not prefillers:  # e.g. a `both` decoder alone in its group: it prefills itself
            self.machine.without_prefiller(original_prompt=original_prompt)
            return await self._local(body, path, kind, original_prompt=original_prompt)
        handover = Handover(
            self.legs,
            settings.connectors[decoder.connector],
            decoder,
            prefillers,
            settings.upstream,
            settings.clock,
            self.request.kv_source,
        )
        try:
            result = await handover.run(body, path, kind, original_prompt=original_prompt)
        except UpstreamError as exc:
            self.prefiller = handover.prefiller  # the last one tried
            fallback = self.machine.prefill_failed(
                retryable=retryable(exc), endpoint=exc.endpoint, original_prompt=original_prompt
            )
            if fallback is None:
                raise
            self.prefiller = None
            self.settings.metrics.count_upstream_error(exc.endpoint, "fell_back")
            return await self._local(body, path, kind, original_prompt=original_prompt)
        self.prefiller = result.prefiller
        if self.answered is None:  # the original prompt's hand-over
            self.answered, self.prefill_cached = handover.answered, handover.prefill_cached
            self.prefill_seconds = leg_seconds(handover.sent, handover.answered)
        return result.leg

    async def _local(self, body: Json, path: str, kind: Kind, *, original_prompt: bool) -> Leg:
        """The decoder alone, with threshold 0: it prefills the prompt itself."""
        return await self.legs.open(
            self.decoder, path, with_threshold(body, 0.0), Phase.DECODE, kind=kind,
            original_prompt=original_prompt,
        )  # fmt: skip

    # -- relaying --------------------------------------------------------------------------------
    async def _relay_all(self, leg: Leg, renderer: Renderer) -> None:
        """Relay ``leg`` and every continuation (hand-backs, recoveries) until finished."""
        while True:
            try:
                handed_back = not await self._relay(leg, renderer)
                step = self.machine.leg_ended(
                    handed_back=handed_back,
                    remaining=self.transcript.remaining,
                    # a hand-back is no failure; a finished leg needs no next decoder
                    next_decoder=self._next_decoder() if handed_back else None,
                )
                if isinstance(step, Done):
                    return
                self.transcript.handbacks = self.machine.handbacks
                self.settings.metrics.handbacks.inc()
                leg = await self._continue(step)
            except UpstreamError as exc:
                leg = await self._recover(exc)

    async def _relay(self, leg: Leg, renderer: Renderer) -> bool:
        """Relay ``leg`` to the client; True when it finished, False when handed back.

        The chunk with the finish reason is held until the leg ended, and what it
        sends after it is only its usage: anything else, no finish at all, or a hand-back
        at threshold 0 is the leg's :meth:`~Leg.fault`, raised before that chunk (or
        any of the faulty part) reaches the client. Whatever ends the leg, the tokens
        the client got of it count in the usage.
        """
        leg.text_offset = self.transcript.offset
        try:
            view = await self._relayed(leg, renderer)
        except BaseException:  # no awaiting `finally` in a compiled module (setup.py)
            await self._leg_ended(leg, complete=False)
            raise
        await self._leg_ended(leg, complete=True)
        self._phase("decode", leg.started)
        return not view.rejected

    async def _relayed(self, leg: Leg, renderer: Renderer) -> ChunkView:
        """:meth:`_relay`'s relaying, to the finish chunk's view (see there)."""
        last: tuple[Json, ChunkView] | None = None
        while (batch := await leg.next_batch()) is not None:
            for chunk in batch:
                view = leg.view(chunk)
                if view.usage is not None:
                    leg.usage = view.usage
                if not view.has_choice:
                    continue
                if last is not None:
                    if view.decisive:
                        raise leg.fault("content after the finish reason")
                elif view.finish_reason is not None:
                    last = (chunk, view)
                else:
                    self._take(leg, chunk, view, renderer)
            await renderer.flush()
        if last is None:
            raise leg.fault("the answer ended without a finish reason")
        chunk, view = last
        if view.rejected and leg.threshold <= 0.0:
            raise leg.fault("cache_threshold at threshold 0")
        self._take(leg, chunk, view, renderer)
        if view.rejected:  # the continuation may take a prefill: send what came now
            await renderer.flush()
        # else the finish chunk goes out with the answer's end, in one write
        return view

    async def _leg_ended(self, leg: Leg, *, complete: bool) -> None:
        """Close ``leg`` and count its usage (only a ``complete`` leg's own report;
        else the tokens the client got of it)."""
        await self.legs.close(leg)
        self.transcript.absorb_usage(
            leg.usage if complete else None,
            original_prompt=leg.original_prompt,
            leg_tokens=leg.tokens,
        )

    def _take(self, leg: Leg, chunk: Json, view: ChunkView, renderer: Renderer) -> None:
        """Record one chunk with a choice and hand it to the client (a hand-back's only
        if it carries tokens); more tokens than the request allows are a fault."""
        transcript = self.transcript
        ids = view.token_ids
        if ids:
            remaining = transcript.remaining
            if remaining is not None and len(ids) > remaining:
                raise leg.fault("more tokens than the request allows")
            leg.tokens += len(ids)
        if transcript.identity is None:
            transcript.adopt_identity(chunk)
        transcript.absorb(view, original_prompt=leg.original_prompt)
        finish = view.finish_reason
        if finish != CACHE_THRESHOLD:
            renderer.emit(leg, chunk, view, finish)
        elif view.text or ids:
            renderer.emit(leg, chunk, view, None)

    # -- continuations (hand-back and recovery) ---------------------------------------------------
    async def _recover(self, exc: UpstreamError) -> Leg:
        """Continue elsewhere after a leg failed mid-answer (or a continuation could not
        start), within ``handback.max_recoveries``; else raise ``exc``."""
        while True:
            machine = self.machine
            if not machine.may_recover(
                retryable=retryable(exc), has_prompt_ids=self.transcript.prompt_ids is not None
            ):
                raise exc
            if exc.phase in _DECODER_PHASES:
                self.legs.broken(exc.endpoint)
            step = machine.recover(self._next_decoder(), self.transcript.remaining)
            if step is None:
                raise exc
            self.settings.metrics.count_upstream_error(exc.endpoint, "recovered")
            try:
                return await self._continue(step)
            except UpstreamError as again:
                exc = again

    async def _continue(self, step: Step) -> Leg:
        """The leg that carries out the machine's continuation ``step`` after
        ``len(generated)`` tokens (a hand-back or a recovery): P/D, the decoder alone,
        or an empty ``length`` answer when the request is at its limit."""
        self._within_budget()
        if not isinstance(step, ThroughPD | Alone):
            return self.legs.answer(self.decoder, self._length_answer(), "completion", False)
        transcript = self.transcript
        prompt = transcript.continuation_prompt()
        self.legs.prompt_tokens = len(prompt)
        threshold = step.threshold if isinstance(step, ThroughPD) else 0.0
        body = continuation_body(
            self.request, prompt, len(transcript.generated), threshold, stream=self.stream_legs
        )
        return await self._step(step, body, COMPLETIONS, "completion", original_prompt=False)

    def _next_decoder(self) -> Endpoint | None:
        """The plan's choice after this request's failures (:meth:`Plan.next_decoder`)."""
        return self.plan.next_decoder(self.legs.failed, self.legs.fleet)

    def _within_budget(self) -> None:
        """502 rather than another leg once the request sent its :func:`leg_budget`."""
        if self.legs.sent < self.budget:
            return
        logger.warning(
            "request %s sent its budget of %d upstream requests without an answer",
            self.request.request_id,
            self.budget,
        )
        raise GatewayError(502, "the upstream answers did not let the request finish")

    def _length_answer(self) -> Json:
        """An empty answer that ends the request at its token limit."""
        identity = self.transcript.identity
        assert identity is not None
        return {
            "id": identity.response_id,
            "object": "text_completion",
            "created": identity.created,
            "model": identity.model,
            "choices": [{"index": 0, "text": "", "token_ids": [], "finish_reason": "length"}],
            "usage": {"completion_tokens": 0},
        }

    async def _ended(self, started: float) -> None:
        """Close every leg still open and time the whole request."""
        await self.legs.aclose()
        self._phase("total", started)

    def _phase(self, phase: str, started: float) -> None:
        self.settings.metrics.observe_phase(phase, self.settings.clock() - started)
