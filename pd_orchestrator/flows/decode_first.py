"""The decode-first flow: ask the decoder, prefill elsewhere only when it says so.

1. **Attempt.** The client's request goes to the planned decoder with the policy's
   ``cache_hit_threshold`` and ``return_token_ids``. A decoder that cannot be
   reached is marked failed and the next planned one is tried.
2. **Admitted** (the first decisive chunk, or the whole answer, carries content or
   an ordinary finish): the answer is relayed. Decision ``decode``.
3. **Rejected** (``finish_reason == "cache_threshold"`` with no tokens, or a stream
   that ends with no choice at all): the connector's prefill body goes to a
   prefiller (retried with backoff across prefillers on 502/503/504 and connection
   failures), its transfer params go to the decoder with threshold 0. A prefill
   answer without params that finished is itself the answer; one that did not is
   followed by a decode leg without params. Decision ``pd``.
4. **Handed back** (``cache_threshold`` after tokens: the decoder preempted the
   request): the original prompt ids plus every generated id are resubmitted as a
   token prompt on ``/v1/completions`` -- prefill on a prefiller, then a decode leg
   with ``handback.leg_threshold`` -- with ``max_tokens``/``min_tokens`` reduced;
   chat clients get the continuation re-rendered as chat chunks. After
   ``handback.max_handbacks`` hand-backs the continuation goes straight to a
   decoder with threshold 0. A decode leg whose connection breaks mid-stream is
   continued the same way on another decoder (``handback.max_recoveries``).

For a stream, the client's response (status and headers) is held until the first
decisive chunk of the serving leg, so ``x-pd-decision`` is always truthful. The
client sees one id, one role chunk and one usage figure: prompt tokens and cached
tokens of the leg that served the original prompt, completion tokens of every leg.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import anyio
from tenacity import (
    AsyncRetrying,
    retry_if_exception,
    stop_after_attempt,
    wait_exponential,
)

from connectors import Connector
from pd_orchestrator.config.settings import GatewayConfig
from pd_orchestrator.fleet.endpoints import Endpoint
from pd_orchestrator.fleet.state import FleetState
from pd_orchestrator.flows.bodies import continuation_body, leg_body, with_threshold
from pd_orchestrator.flows.chunks import (
    ChunkView,
    answer_as_chunks,
    identity_fields,
    relay_chunk,
    render_chunk,
    view_answer,
    view_chunk,
)
from pd_orchestrator.flows.request import ClientRequest
from pd_orchestrator.flows.sink import ClientSink, GatewayError
from pd_orchestrator.flows.transcript import Transcript
from pd_orchestrator.openai.responses import Kind
from pd_orchestrator.openai.sse import DONE, encode_event
from pd_orchestrator.planner.plan import Plan
from pd_orchestrator.routing.types import Candidate
from pd_orchestrator.telemetry.metrics import GatewayMetrics
from pd_orchestrator.upstream.client import ChunkStream, Phase, Upstream
from pd_orchestrator.upstream.errors import (
    UpstreamError,
    UpstreamProtocolError,
    UpstreamStatusError,
    UpstreamTimeout,
    UpstreamUnavailable,
)

__all__ = ["DecodeFirstFlow", "FlowContext"]

Json = dict[str, Any]
COMPLETIONS = "/v1/completions"


@dataclass(frozen=True)
class FlowContext:
    """What a flow needs from the gateway: I/O, configuration, state and decisions.

    ``prefillers_for(decoder)`` ranks the prefillers whose KV can reach ``decoder``;
    ``pick_decoder()`` chooses the decoder a continuation goes to now;
    ``connector_for(decoder)`` is the KV-connector adapter of the decoder's pool;
    ``candidates()`` is the fleet now (health, in-flight counts, load readings);
    ``observe(outcome)`` learns from a served request (threshold feedback);
    ``routed(decoder)`` reports the decoder that took the request (prefix scorers).
    """

    upstream: Upstream
    config: GatewayConfig
    fleet: FleetState
    metrics: GatewayMetrics
    prefillers_for: Callable[[Endpoint], tuple[Endpoint, ...]]
    pick_decoder: Callable[[], Endpoint]
    connector_for: Callable[[Endpoint], Connector]
    candidates: Callable[[], tuple[Candidate, ...]]
    observe: Callable[[FlowOutcome], None]
    routed: Callable[[Endpoint], None]
    clock: Callable[[], float]


@dataclass(frozen=True, slots=True)
class FlowOutcome:
    """What a served request taught: who served it, its TTFT, mean ITL, prompt tokens."""

    decoder: Endpoint
    decision: str
    ttft: float | None
    itl: float | None
    prompt_tokens: int | None


class _AnswerChunks:
    """A whole answer replayed as the chunks of a stream (same interface as ChunkStream)."""

    def __init__(self, chunks: Iterable[Json]) -> None:
        self._chunks = iter(list(chunks))

    def __aiter__(self) -> _AnswerChunks:
        return self

    async def __anext__(self) -> Json:
        try:
            return next(self._chunks)
        except StopIteration:
            raise StopAsyncIteration from None

    async def aclose(self) -> None:
        return None


LegSource = ChunkStream | _AnswerChunks
Send = Callable[[bytes], Awaitable[None]]


async def _discard(data: bytes) -> None:
    """A ``Send`` that drops what it gets (the transcript keeps what matters)."""
    return None


@dataclass
class _Leg:
    """One upstream answer being relayed."""

    endpoint: Endpoint
    kind: Kind
    source: LegSource
    original_prompt: bool
    threshold: float
    started: float
    held: list[Json] = field(default_factory=list)
    tokens: int = 0
    usage: Json | None = None


def _retryable(exc: BaseException) -> bool:
    if isinstance(exc, UpstreamStatusError):
        return exc.retryable
    return isinstance(exc, UpstreamUnavailable | UpstreamTimeout | UpstreamProtocolError)


class DecodeFirstFlow:
    """Serves one client request; see the module docstring.

    ``stream_legs``: whether decoder legs are streamed even for a client that wants
    a whole answer (the answer is then assembled from the stream); decode-first
    streams only for streaming clients.
    """

    stream_legs = False

    def __init__(self, ctx: FlowContext, request: ClientRequest, plan: Plan) -> None:
        self.ctx = ctx
        self.request = request
        self.plan = plan
        self.transcript = Transcript(request)
        self.decision = "decode"
        self.decoder: Endpoint = plan.decoder
        self.prefiller: Endpoint | None = None
        self.recoveries = 0
        self._legs = 0
        self._role_sent = False
        self._first_sent = False
        self._open: list[LegSource] = []
        self._ttft_seen = False
        self._ttft: float | None = None
        self._gaps = 0
        self._last_token_at = 0.0

    # -- entry -------------------------------------------------------------------------
    async def run(self, sink: ClientSink) -> None:
        """Serve the request into ``sink``; raises GatewayError/UpstreamError on failure."""
        started = self.ctx.clock()
        try:
            if self.request.stream:
                await self._serve_stream(sink)
            elif self.stream_legs:
                await self._serve_whole_streamed(sink)
            else:
                await self._serve_whole(sink)
            self.ctx.observe(self._outcome())
        finally:
            await self._close_all()
            self.ctx.metrics.phase_seconds.labels("total").observe(self.ctx.clock() - started)

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

    # -- whole answers -------------------------------------------------------------------
    async def _serve_whole(self, sink: ClientSink) -> None:
        answer = await self._attempt_whole()
        view = view_answer(answer, self.request.kind)
        self.ctx.routed(self.decoder)
        if view.rejected and not view.token_ids and not view.completion_tokens:
            self.decision = "pd"
            answer, view = await self._pd_whole()
        self._record_whole(answer, view, self.request.kind, original_prompt=True)
        while view.rejected:
            answer, view = await self._continue_whole()
            self._record_whole(answer, view, "completion", original_prompt=False)
        headers = self.headers() | {"x-pd-handbacks": str(self.transcript.handbacks)}
        await sink.start(200, headers, "application/json")
        await sink.send(json.dumps(self.transcript.whole_answer()).encode())
        self._observe_ttft()

    async def _attempt_whole(self) -> Json:
        body = leg_body(self.request, self.plan.threshold.value)
        started = self.ctx.clock()
        for decoder in self._decoder_candidates():
            self.decoder = decoder
            try:
                answer = await self._post(decoder, self.request.path, body, Phase.DECODE_ATTEMPT)
            except UpstreamUnavailable:
                self.ctx.fleet.record_failure(decoder.name)
                if decoder is self.plan.decoders[-1]:
                    raise
                continue
            self._phase("decode_attempt", started)
            return answer
        raise GatewayError(503, "no decoder is available")

    async def _pd_whole(self) -> tuple[Json, ChunkView]:
        base = leg_body(self.request, 0.0)
        answer, outcome_params, finished = await self._prefill(base, self.request.path)
        if outcome_params is None and finished:
            return answer, view_answer(answer, self.request.kind)
        body = with_threshold(self._connector.decode_body(base, outcome_params), 0.0)
        started = self.ctx.clock()
        answer = await self._post(self.decoder, self.request.path, body, Phase.DECODE)
        self._phase("decode", started)
        return answer, view_answer(answer, self.request.kind)

    async def _continue_whole(self) -> tuple[Json, ChunkView]:
        source, _kind = await self._continuation(stream=False)
        chunks = [chunk async for chunk in source]
        answer = chunks[0]
        return answer, view_answer(answer, "completion")

    def _record_whole(
        self, answer: Json, view: ChunkView, kind: Kind, *, original_prompt: bool
    ) -> None:
        transcript = self.transcript
        transcript.adopt_identity(answer)
        if transcript.template is None and kind == self.request.kind:
            transcript.template = answer
        transcript.absorb(view, original_prompt=original_prompt)
        transcript.absorb_usage(
            view.usage, original_prompt=original_prompt, leg_tokens=len(view.token_ids or ())
        )

    # -- streams ---------------------------------------------------------------------------
    async def _serve_stream(self, sink: ClientSink) -> None:
        leg = await self._first_leg()
        await sink.start(200, self.headers(), "text/event-stream")
        await self._relay_all(leg, sink.send)
        if self.request.include_usage and self.transcript.identity is not None:
            usage = self.transcript.usage().as_dict()
            identity = identity_fields(self.transcript.identity, self.request.kind)
            await sink.send(encode_event({**identity, "choices": [], "usage": usage}))
        await sink.send(DONE)

    async def _serve_whole_streamed(self, sink: ClientSink) -> None:
        """A whole answer assembled from streamed legs."""
        leg = await self._first_leg()
        await self._relay_all(leg, _discard)
        transcript = self.transcript
        if transcript.template is None:
            transcript.template = transcript.blank_answer()
        headers = self.headers() | {"x-pd-handbacks": str(transcript.handbacks)}
        await sink.start(200, headers, "application/json")
        await sink.send(json.dumps(transcript.whole_answer()).encode())

    async def _first_leg(self) -> _Leg:
        """The leg that serves the original prompt: the attempt, or P/D after a rejection."""
        leg = await self._attempt_stream()
        if leg is None:
            self.decision = "pd"
            self.ctx.routed(self.decoder)
            return await self._pd_stream()
        self.ctx.routed(self.decoder)
        return leg

    async def _relay_all(self, leg: _Leg | None, send: Send) -> None:
        """Relay ``leg`` and every continuation (hand-backs, recoveries) until finished."""
        while leg is not None:
            try:
                finished = await self._pump(send, leg)
            except (UpstreamProtocolError, UpstreamUnavailable, UpstreamTimeout) as exc:
                leg = await self._recover(exc)
                continue
            leg = None if finished else await self._handback_stream()

    def _leg_body(self, threshold: float) -> Json:
        """The client's body for a decoder leg (streamed when ``stream_legs``)."""
        body = leg_body(self.request, threshold)
        if self.stream_legs and not self.request.stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        return body

    async def _attempt_stream(self) -> _Leg | None:
        """Open the attempt and read to its first decisive chunk; None if rejected."""
        body = self._leg_body(self.plan.threshold.value)
        for decoder in self._decoder_candidates():
            self.decoder = decoder
            try:
                leg = await self._open_leg(
                    decoder, self.request.path, body, Phase.DECODE_ATTEMPT, self.request.kind
                )
            except UpstreamUnavailable:
                self.ctx.fleet.record_failure(decoder.name)
                if decoder is self.plan.decoders[-1]:
                    raise
                continue
            decisive = await self._read_until_decisive(leg)
            self._phase("decode_attempt", leg.started)
            if decisive is None or (decisive.rejected and not decisive.token_ids):
                await self._discard(leg)
                return None
            return leg
        raise GatewayError(503, "no decoder is available")

    async def _pd_stream(self) -> _Leg:
        base = self._leg_body(0.0)
        answer, params, finished = await self._prefill(base, self.request.path)
        if params is None and finished:
            source = _AnswerChunks(answer_as_chunks(answer, self.request.kind))
            return self._leg(self.prefiller or self.decoder, self.request.kind, source, True, 0.0)
        body = with_threshold(self._connector.decode_body(base, params), 0.0)
        leg = await self._open_leg(
            self.decoder, self.request.path, body, Phase.DECODE, self.request.kind
        )
        await self._read_until_decisive(leg)
        return leg

    async def _handback_stream(self) -> _Leg | None:
        source, kind = await self._continuation(stream=True)
        return self._leg(self.decoder, kind, source, False, 0.0)

    async def _recover(self, exc: UpstreamError) -> _Leg | None:
        """Continue elsewhere after a decode leg broke mid-stream, or give up."""
        limit = self.ctx.config.handback.max_recoveries
        if self.recoveries >= limit or self.transcript.prompt_ids is None:
            raise exc
        self.recoveries += 1
        self.ctx.fleet.mark_unhealthy(exc.endpoint)
        self.ctx.metrics.upstream_errors.labels(exc.endpoint, "recovered").inc()
        source, kind = await self._continuation(stream=True, recovering=True)
        return self._leg(self.decoder, kind, source, False, 0.0)

    async def _read_until_decisive(self, leg: _Leg) -> ChunkView | None:
        async for chunk in leg.source:
            leg.held.append(chunk)
            view = view_chunk(chunk, leg.kind)
            if view.decisive:
                return view
        return None

    async def _pump(self, send: Send, leg: _Leg) -> bool:
        """Relay ``leg`` to the client; True when finished, False when handed back."""
        handed_back = False
        finished = False
        for chunk in self._chunks_of(leg):
            handed_back, finished = await self._relay_one(send, leg, chunk, handed_back, finished)
        async for chunk in leg.source:
            handed_back, finished = await self._relay_one(send, leg, chunk, handed_back, finished)
        self._close_leg(leg)
        if handed_back:
            return False
        if not finished:
            raise UpstreamProtocolError(
                leg.endpoint.name, "decode", "stream ended without a finish reason", role="decoder"
            )
        return True

    @staticmethod
    def _chunks_of(leg: _Leg) -> list[Json]:
        held, leg.held = leg.held, []
        return held

    async def _relay_one(
        self, send: Send, leg: _Leg, chunk: Json, handed_back: bool, finished: bool
    ) -> tuple[bool, bool]:
        view = view_chunk(chunk, leg.kind)
        if view.usage is not None:
            leg.usage = view.usage
        if not view.has_choice:
            return handed_back, finished
        leg.tokens += len(view.token_ids or ())
        self.transcript.adopt_identity(chunk)
        self.transcript.absorb(view, original_prompt=leg.original_prompt)
        if view.rejected:
            if view.text or view.token_ids:
                await self._emit(send, leg, chunk, view, finish=None)
            return True, finished
        await self._emit(send, leg, chunk, view, finish=view.finish_reason)
        return handed_back, finished or view.finish_reason is not None

    async def _emit(
        self, send: Send, leg: _Leg, chunk: Json, view: ChunkView, finish: str | None
    ) -> None:
        identity = self.transcript.identity
        assert identity is not None
        keep_ids = self.request.want_token_ids
        role_only = leg.kind == "chat" and not view.decisive
        if role_only and self._role_sent:
            return
        if leg.kind == self.request.kind and finish == view.finish_reason:
            out = relay_chunk(chunk, identity, keep_ids=keep_ids, first=not self._first_sent)
        else:
            if self.request.kind == "chat" and not self._role_sent:
                await self._send_role(send)
            out = render_chunk(view, identity, self.request.kind, keep_ids=keep_ids, finish=finish)
        self._role_sent = self._role_sent or self.request.kind == "chat"
        await send(encode_event(out))
        self._first_sent = True
        if view.text or view.token_ids:
            self._observe_ttft()

    async def _send_role(self, send: Send) -> None:
        identity = self.transcript.identity
        assert identity is not None
        chunk = {
            **identity_fields(identity, "chat"),
            "choices": [
                {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                 "finish_reason": None}
            ],
        }  # fmt: skip
        self._role_sent = True
        await send(encode_event(chunk))

    # -- continuation (hand-back and recovery) ----------------------------------------------
    async def _continuation(
        self, *, stream: bool, recovering: bool = False
    ) -> tuple[LegSource, Kind]:
        transcript = self.transcript
        if not recovering:
            transcript.handbacks += 1
            self.ctx.metrics.handbacks.inc()
        remaining = transcript.remaining
        if remaining is not None and remaining <= 0:
            return self._final_length(), "completion"
        self.decoder = self.ctx.pick_decoder()
        local = not recovering and transcript.handbacks > self.ctx.config.handback.max_handbacks
        threshold = 0.0 if local else self.ctx.config.handback.leg_threshold
        body = continuation_body(
            self.request, transcript.continuation_prompt(), len(transcript.generated), threshold
        )
        body["stream"] = stream
        if local:
            return await self._decode_source(body, stream), "completion"
        answer, params, finished = await self._prefill(body, COMPLETIONS)
        if params is None and finished:
            return _AnswerChunks([answer]), "completion"
        decode = with_threshold(self._connector.decode_body(body, params), threshold)
        return await self._decode_source(decode, stream), "completion"

    async def _decode_source(self, body: Json, stream: bool) -> LegSource:
        if stream:
            source = await self.ctx.upstream.open_stream(
                self.decoder, COMPLETIONS, body, phase=Phase.DECODE, headers=self._leg_headers()
            )
            self._open.append(source)
            return source
        answer = await self._post(self.decoder, COMPLETIONS, body, Phase.DECODE)
        return _AnswerChunks([answer])

    def _final_length(self) -> _AnswerChunks:
        identity = self.transcript.identity
        assert identity is not None
        chunk = {
            **identity_fields(identity, "completion"),
            "choices": [{"index": 0, "text": "", "token_ids": [], "finish_reason": "length"}],
            "usage": {"completion_tokens": 0},
        }
        return _AnswerChunks([chunk])

    # -- prefill ------------------------------------------------------------------------------
    async def _prefill(self, body: Json, path: str) -> tuple[Json, dict[str, Any] | None, bool]:
        """Prefill ``body`` on a prefiller; returns the answer, transfer params, finished."""
        candidates = self.ctx.prefillers_for(self.decoder)
        if not candidates:
            raise GatewayError(503, f"no prefiller can hand KV over to decoder {self.decoder.name}")
        config = self.ctx.config.upstream
        prefill_body = self._connector.prefill_body(body)
        started = self.ctx.clock()
        retrying = AsyncRetrying(
            stop=stop_after_attempt(config.prefill_attempts),
            wait=wait_exponential(multiplier=config.retry_backoff, max=2.0),
            retry=retry_if_exception(_retryable),
            reraise=True,
        )
        answer: Json = {}
        async for attempt in retrying:
            with attempt:
                index = (attempt.retry_state.attempt_number - 1) % len(candidates)
                self.prefiller = candidates[index]
                answer = await self._post(self.prefiller, path, prefill_body, Phase.PREFILL)
        self._phase("prefill", started)
        outcome = self._connector.read_prefill(answer)
        return answer, outcome.params, outcome.finished

    # -- plumbing -------------------------------------------------------------------------------
    def _decoder_candidates(self) -> tuple[Endpoint, ...]:
        return self.plan.decoders

    @property
    def _connector(self) -> Connector:
        return self.ctx.connector_for(self.decoder)

    def _leg_headers(self) -> dict[str, str]:
        self._legs += 1
        return {"X-Request-Id": f"{self.request.request_id}-{self._legs}"}

    async def _post(self, endpoint: Endpoint, path: str, body: Json, phase: Phase) -> Json:
        try:
            with self.ctx.fleet.in_flight(endpoint.name):
                answer = await self.ctx.upstream.post_json(
                    endpoint, path, body, phase=phase, headers=self._leg_headers()
                )
        except UpstreamError as exc:
            self.ctx.metrics.upstream_errors.labels(endpoint.name, type(exc).__name__).inc()
            raise
        self.ctx.fleet.record_success(endpoint.name)
        return answer

    async def _open_leg(
        self, endpoint: Endpoint, path: str, body: Json, phase: Phase, kind: Kind
    ) -> _Leg:
        started = self.ctx.clock()
        try:
            source = await self.ctx.upstream.open_stream(
                endpoint, path, body, phase=phase, headers=self._leg_headers()
            )
        except UpstreamError as exc:
            self.ctx.metrics.upstream_errors.labels(endpoint.name, type(exc).__name__).inc()
            raise
        self.ctx.fleet.record_success(endpoint.name)
        self._open.append(source)
        return _Leg(endpoint, kind, source, True, body.get("cache_hit_threshold", 0.0), started)

    def _leg(
        self, endpoint: Endpoint, kind: Kind, source: LegSource, original: bool, threshold: float
    ) -> _Leg:
        if isinstance(source, ChunkStream):
            self._open.append(source)
        return _Leg(endpoint, kind, source, original, threshold, self.ctx.clock())

    def _close_leg(self, leg: _Leg) -> None:
        self.transcript.absorb_usage(
            leg.usage, original_prompt=leg.original_prompt, leg_tokens=leg.tokens
        )
        self._phase("decode", leg.started)

    async def _discard(self, leg: _Leg) -> None:
        await self._close_source(leg.source)

    async def _close_source(self, source: LegSource) -> None:
        with anyio.move_on_after(2, shield=True):
            await source.aclose()
        if source in self._open:
            self._open.remove(source)

    async def _close_all(self) -> None:
        for source in list(self._open):
            await self._close_source(source)

    def _phase(self, phase: str, started: float) -> None:
        self.ctx.metrics.phase_seconds.labels(phase).observe(self.ctx.clock() - started)

    def _observe_ttft(self) -> None:
        now = self.ctx.clock()
        if not self._ttft_seen:
            self._ttft_seen = True
            self._ttft = now - self.request.arrival
            self.ctx.metrics.ttft.observe(self._ttft)
        else:
            self._gaps += 1
        self._last_token_at = now

    def _outcome(self) -> FlowOutcome:
        itl = None
        if self._gaps and self._ttft is not None:
            first = self.request.arrival + self._ttft
            itl = (self._last_token_at - first) / self._gaps
        return FlowOutcome(
            self.decoder, self.decision, self._ttft, itl, self.transcript.prompt_tokens
        )
