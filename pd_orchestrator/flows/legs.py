"""Legs: the one way a flow opens or posts an upstream request.

A :class:`Legs` object belongs to one client request. Every upstream request of that
request goes through it, so every one is treated alike:

* counted in flight on its endpoint from the moment it is sent until it is read to
  the end or closed (a stream for as long as it streams), and its prompt's tokens in
  the endpoint's backlog until its first decisive chunk or its one-token answer
  (a prefill, a probe), and for as long, the prompt's block keys
  (:attr:`Legs.blocks`) pending there (:attr:`FleetState.pending`: the server will
  hold them by the time it reaches a later prompt that shares them). None for a
  ``/tokenize`` or a decode leg whose KV a connector brings (nothing to prefill),
  nor for a whole answer of more tokens (it comes after its last token, not its
  first: the endpoint's reading covers it);
* its success or failure reported to the fleet: a failure when it happens
  (:meth:`FleetState.record_error`: a connection that cannot be made counts as a
  failed check; outlier detection counts 5xx answers, broken connections, timeouts
  and protocol errors), a success once its answer was read to the end -- a stream's
  start only shows the endpoint is up (:meth:`FleetState.record_accepted`), an
  answer that breaks or turns out malformed is a failure; a leg the flow gives up on
  mid-answer marks its endpoint unhealthy (:meth:`Legs.broken`);
* read as vLLM answers: a field of a type vLLM never sends, ``cache_threshold``
  from a leg sent with threshold 0 (vLLM rejects only below a threshold), or no
  content within :data:`MAX_HELD` chunks is a protocol error of the endpoint
  (:meth:`Leg.fault`);
* given a read timeout that grows with the request's prompt (:attr:`Legs.prompt_tokens`:
  prefilling a long prompt takes time; ``timeouts.per_1k_prompt_tokens``);
* counted (:attr:`Legs.sent`: the flow holds each request to a budget of them);
* counted by endpoint, phase and outcome, with its duration
  (``pd_orchestrator_upstream_requests_total``, ``pd_orchestrator_upstream_seconds``);
  a prefill sent again after a failed one is a retry
  (``pd_orchestrator_prefill_retries_total``), a decode leg that carries KV transfer
  parameters a hand-over (``pd_orchestrator_kv_transfers_total``);
* its failures -- when it is sent, or mid-answer -- counted in
  ``pd_orchestrator_upstream_errors_total`` and logged once, with the endpoint's
  name, the phase and the upstream's own message (the one place they are logged;
  the client gets the gateway's words);
* given an id (``X-Request-Id: <request id>-<n>``), the request's ``forward``
  headers (the client's ``Authorization`` unless the endpoint's pool has its own
  key, which replaces it) and, when tracing, a span of its own whose
  ``traceparent`` it carries;
* encoded through the request's ``encoding``
  (:class:`~pd_orchestrator.flows.bodies.SharedEncoding`) when it has one: the
  client's large values once for all its legs, the legs of all its choices too;
* closed when the request ends, whatever ends it (:meth:`Legs.aclose`, shielded and
  bounded).

A :class:`Leg` is an answer being read, in batches of chunks. A leg the client's
body asks to stream is read as SSE; otherwise its whole answer is the leg's one
batch (``whole``), so a flow relays both alike, and both are accounted for when
they are closed.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
from opentelemetry.trace import Span

from pd_orchestrator.fleet.state import FleetState
from pd_orchestrator.flows.bodies import Encoded, SharedEncoding
from pd_orchestrator.flows.chunks import ChunkView, MalformedChunk, view_answer, view_chunk
from pd_orchestrator.model.endpoints import Endpoint, Role
from pd_orchestrator.openai.responses import Kind
from pd_orchestrator.telemetry.metrics import GatewayMetrics
from pd_orchestrator.telemetry.tracing import RequestTrace
from pd_orchestrator.upstream.client import ChunkStream, Phase, Upstream, role_label
from pd_orchestrator.upstream.errors import (
    UpstreamError,
    UpstreamProtocolError,
)

__all__ = ["CLOSE_SECONDS", "MAX_HELD", "Leg", "Legs"]

Json = dict[str, Any]
CLOSE_SECONDS = 2.0
"""How long closing one leg may take before it is abandoned."""
MAX_HELD = 64
"""Chunks a leg may send before its first decisive one (vLLM sends at most a role
chunk first: every generated token comes with its id)."""
logger = logging.getLogger("pd_orchestrator.upstream")


class _Whole:
    """A whole answer as a source of one batch."""

    def __init__(self, answer: Json) -> None:
        self._batch: list[Json] | None = [answer]

    def __aiter__(self) -> _Whole:
        return self

    async def __anext__(self) -> list[Json]:
        batch, self._batch = self._batch, None
        if batch is None:
            raise StopAsyncIteration
        return batch


@dataclass(slots=True, eq=False)
class Leg:
    """One upstream answer being read.

    ``kind``: the API its chunks speak. ``whole``: its one batch is a whole answer.
    ``original_prompt``: it serves the client's prompt (not a continuation).
    ``held``: chunks read ahead (to the first decisive one) and not yet relayed.
    ``backlog``, ``blocks`` and ``on_answer``: the prompt tokens the leg holds in its
    endpoint's backlog, the block keys it holds pending there, and what gives both
    back (called at the first decisive chunk).
    ``tokens`` and ``usage``: the tokens of it the client got and what it reported.
    ``text_offset``: characters of answer the client got before this leg (its
    completions logprobs' offsets start there).
    ``ended``: read to its end; ``error``: what broke it or was wrong with it
    (reported to the fleet when it is closed); ``phase`` and ``span``: how
    :class:`Legs` accounts for it when it closes.
    """

    endpoint: Endpoint
    kind: Kind
    source: AsyncIterator[list[Json]]
    whole: bool
    original_prompt: bool
    started: float
    threshold: float = 0.0
    held: list[Json] = field(default_factory=list)
    decisive: ChunkView | None = None
    views: dict[int, ChunkView] = field(default_factory=dict)
    tokens: int = 0
    usage: Json | None = None
    open: bool = True
    ended: bool = False
    error: UpstreamError | None = None
    phase: str = ""
    span: Span | None = None
    backlog: int = 0
    blocks: Sequence[int] = ()
    on_answer: Callable[[Leg], None] | None = None
    text_offset: int = 0

    def view(self, chunk: Json) -> ChunkView:
        """What ``chunk`` (an answer when ``whole``) says (read once per held chunk);
        a malformed one is the leg's fault (:meth:`fault`)."""
        views = self.views
        if views:
            seen = views.pop(id(chunk), None)
            if seen is not None:
                return seen
        try:
            return view_answer(chunk, self.kind) if self.whole else view_chunk(chunk, self.kind)
        except MalformedChunk as exc:
            raise self.fault(str(exc)) from None

    def take_error(self) -> UpstreamError | None:
        """The leg's error, if it failed, which the leg then lets go of: the error's
        traceback holds the leg's frames, a cycle that would keep the leg and its whole
        request until a full collection."""
        error, self.error = self.error, None
        return error

    def fault(self, message: str) -> UpstreamProtocolError:
        """The leg's answer is not what vLLM sends: a protocol error of its endpoint,
        which the leg keeps (reported when it is closed) and returns to be raised."""
        error = UpstreamProtocolError(
            self.endpoint.name, self.phase, message, role=role_label(self.endpoint)
        )
        self.error = error
        return error

    async def read_until_decisive(self) -> ChunkView | None:
        """Hold chunks until one carries content or a finish; None if none does.

        Raises the leg's :meth:`fault` for a rejection at threshold 0 (``cache_threshold``,
        or an answer with no choice: vLLM admits every request at 0) and for a stream
        with no decisive chunk among its first :data:`MAX_HELD`.
        """
        if self.decisive is not None:
            return self.decisive
        while (batch := await self._next()) is not None:
            self.held.extend(batch)
            for chunk in batch:
                view = self.view(chunk)
                self.views[id(chunk)] = view  # the relay reads it from here
                if view.decisive:
                    if view.rejected and self.threshold <= 0.0:
                        raise self.fault("cache_threshold at threshold 0")
                    self.decisive = view
                    if self.on_answer is not None:
                        self.on_answer(self)
                    return view
            if len(self.held) > MAX_HELD:
                raise self.fault(f"no content in the first {MAX_HELD} chunks")
        if self.threshold <= 0.0:
            raise self.fault("an answer with no content and no finish reason")
        return None

    async def next_batch(self) -> list[Json] | None:
        """The held chunks first, then the next batch; None at the end."""
        if self.held:
            held, self.held = self.held, []
            return held
        return await self._next()

    async def _next(self) -> list[Json] | None:
        try:
            return await self.source.__anext__()
        except StopAsyncIteration:
            self.ended = True
            return None
        except UpstreamError as exc:
            self.error = exc
            raise


class Legs:
    """Every upstream request of one client request (see the module docstring).

    ``sent``: upstream requests sent so far. ``prompt_tokens``: the size of the prompt
    the next legs carry, which lengthens their read timeouts (the flow sets it: the
    plan's estimate, then each continuation's token prompt). ``blocks``: the block
    keys of the prompt's leading blocks (the plan's; a continuation's start with
    them), held pending with a leg's backlog.
    """

    def __init__(
        self,
        upstream: Upstream,
        fleet: FleetState,
        metrics: GatewayMetrics,
        request_id: str,
        clock: Callable[[], float],
        *,
        forward: Mapping[str, str] | None = None,
        trace: RequestTrace | None = None,
        encoding: SharedEncoding | None = None,
    ) -> None:
        self.upstream = upstream
        self.fleet = fleet
        self.metrics = metrics
        self.request_id = request_id
        self.clock = clock
        self.forward = forward
        self.trace = trace
        self.encoding = encoding
        self.failed: set[str] = set()
        self.prompt_tokens = 0
        self.blocks: Sequence[int] = ()
        self.sent = 0
        self._count = 0
        self._open: list[tuple[Leg, ChunkStream | None]] = []
        self._prefill_failed = False

    def next_id(self) -> str:
        """A new leg id: ``<request id>-<n>``."""
        self._count += 1
        return f"{self.request_id}-{self._count}"

    def _encoded(self, body: Json) -> Json | Encoded:
        """``body`` as the upstream client sends it: in pieces through the request's
        :attr:`encoding` (its large values encoded once), else as it is."""
        return body if self.encoding is None else self.encoding.encode(body)

    def allowance(self) -> float:
        """Seconds the read timeouts of the next legs grow by for their prompt's size."""
        return self.upstream.allowance(self.prompt_tokens)

    def _headers(
        self, endpoint: Endpoint, span: Span | None, extra: Mapping[str, str] | None
    ) -> dict[str, str]:
        headers = {"x-request-id": self.next_id()}
        if self.forward:
            headers.update(self.forward)
        if endpoint.authorization is not None:
            headers["authorization"] = endpoint.authorization
        if span is not None and self.trace is not None:
            self.trace.inject(span, headers)
        if extra:
            for name, value in extra.items():
                headers[name.lower()] = value
        return headers

    def faulted(self, endpoint: Endpoint, exc: UpstreamError) -> UpstreamError:
        """Count and log ``exc``, a fault found in an answer already taken (the answer
        itself counted as answered): returned for the caller to raise."""
        self._failure(endpoint, exc, exc.phase)
        return exc

    def _failure(self, endpoint: Endpoint, exc: UpstreamError, phase: str) -> None:
        """Count and log a failed leg (the one place upstream failures are logged); the
        gateway's own failure (:attr:`UpstreamError.gateways_own`) is counted as the
        gateway's and nothing is held against the endpoint."""
        if exc.gateways_own:
            self.metrics.count_resource_error(getattr(exc, "resource", "other"))
            logger.warning("the gateway could not reach %s during %s: %s (its own limit)",
                           endpoint.name, phase, exc.message)  # fmt: skip
            exc.logged = True
            return
        self.metrics.count_upstream_error(endpoint.name, type(exc).__name__)
        self.failed.add(endpoint.name)
        self.fleet.record_error(endpoint.name, exc)
        if phase == "prefill":
            self._prefill_failed = True
        logger.log(
            logging.WARNING if exc.endpoint_at_fault else logging.INFO,
            "upstream %s failed during %s (%s): %s",
            endpoint.name,
            phase,
            type(exc).__name__,
            exc.message,
        )
        exc.logged = True

    async def post(
        self,
        endpoint: Endpoint,
        path: str,
        body: Json,
        phase: Phase,
        *,
        headers: Mapping[str, str] | None = None,
        label: str | None = None,
    ) -> Json:
        """POST ``body`` and return the whole answer (``headers`` add to or replace the
        leg's own, e.g. a connector's shared ``X-Request-Id``). ``label`` names the leg
        in metrics and traces when its phase does not say enough (``probe``)."""
        name: str = label or phase  # a StrEnum: its value as a label
        span = self._span(name, endpoint, name)
        started = self.clock()
        answer = await self._post(endpoint, path, body, phase, name, span, headers)
        self.fleet.record_success(endpoint.name)
        self.metrics.count_leg(endpoint.name, name, "ok", self.clock() - started)
        if span is not None:
            RequestTrace.end_leg(span, "ok", _usage_attributes(answer.get("usage")))
        return answer

    def _span(self, span_name: str, endpoint: Endpoint, phase: str) -> Span | None:
        trace = self.trace
        return None if trace is None else trace.leg(span_name, endpoint.name, phase)

    async def _post(
        self,
        endpoint: Endpoint,
        path: str,
        body: Json,
        phase: Phase,
        name: str,
        span: Span | None,
        extra: Mapping[str, str] | None,
    ) -> Json:
        """The whole answer to ``body``; its failures accounted for, not its success."""
        if self._prefill_failed and name == "prefill":
            self._prefill_failed = False
            self.metrics.prefill_retries.inc()
        backlog = self._backlog(phase, body, stream=False)
        blocks = self._enter(endpoint, backlog)
        try:
            answer = await self.upstream.post_json(
                endpoint, path, self._encoded(body), phase=phase,
                headers=self._headers(endpoint, span, extra), prompt_tokens=self.prompt_tokens,
            )  # fmt: skip
        except BaseException as exc:
            self._abandon(endpoint, name, span, backlog, blocks, exc)
            raise
        self.fleet.leave(endpoint.name, backlog, blocks)
        return answer

    def _enter(self, endpoint: Endpoint, backlog: int) -> Sequence[int]:
        """One upstream request starts: counted in :attr:`sent`, in flight on
        ``endpoint`` until it ends (a whole answer's) or is closed (a stream's), its
        ``backlog``, and the prompt's :attr:`blocks` with it (returned), until its first
        decisive chunk. Pair with ``fleet.leave`` or :meth:`_abandon`."""
        self.sent += 1
        blocks = self.blocks if backlog else ()
        self.fleet.enter(endpoint.name, backlog, blocks)
        return blocks

    def _abandon(
        self,
        endpoint: Endpoint,
        name: str,
        span: Span | None,
        backlog: int,
        blocks: Sequence[int],
        exc: BaseException,
    ) -> None:
        """A request :meth:`_enter` started ended in ``exc`` before its answer: out of
        flight, and its failure or cancellation accounted for here, the one place."""
        self.fleet.leave(endpoint.name, backlog, blocks)
        if isinstance(exc, UpstreamError):
            self._failed_leg(endpoint, exc, name, span)
        else:
            self._cancelled_leg(endpoint, name, span)

    def _backlog(self, phase: Phase, body: Json, *, stream: bool) -> int:
        """Prompt tokens the leg holds in its endpoint's backlog (module docstring)."""
        if phase is Phase.TOKENIZE or phase is Phase.PROBE:
            return 0
        if phase is Phase.DECODE and "kv_transfer_params" in body:
            return 0
        if not stream and body.get("max_tokens") != 1:
            return 0
        return self.prompt_tokens

    def _answered(self, leg: Leg) -> None:
        """``leg``'s first decisive chunk came (or it closed first): its backlog is out."""
        if leg.backlog:
            self.fleet.answered(leg.endpoint.name, leg.backlog, leg.blocks)
            leg.backlog, leg.blocks = 0, ()

    def _failed_leg(
        self, endpoint: Endpoint, exc: UpstreamError, phase: str, span: Span | None
    ) -> None:
        outcome = exc.outcome
        self._failure(endpoint, exc, phase)
        if not exc.gateways_own:  # never sent: not a leg of the endpoint's
            self.metrics.count_leg(endpoint.name, phase, outcome, None)
        if span is not None:
            RequestTrace.end_leg(span, outcome, {"pd.error": str(exc)})

    def _cancelled_leg(self, endpoint: Endpoint, phase: str, span: Span | None) -> None:
        """A leg abandoned before its answer came (the request was cancelled)."""
        self.metrics.count_leg(endpoint.name, phase, "cancelled", None)
        if span is not None:
            RequestTrace.end_leg(span, "cancelled")

    async def open(
        self,
        endpoint: Endpoint,
        path: str,
        body: Json,
        phase: Phase,
        *,
        kind: Kind,
        original_prompt: bool = True,
        headers: Mapping[str, str] | None = None,
    ) -> Leg:
        """Send ``body``: a stream when it says ``stream``, else a whole answer (either
        accounted for when it is closed)."""
        threshold = float(body.get("cache_hit_threshold") or 0.0)
        name: str = phase  # a StrEnum: its value as a label
        span_name = name
        if phase is Phase.DECODE:
            if "kv_transfer_params" in body:
                self.metrics.count_kv_transfer(endpoint.connector)
            if not original_prompt:
                span_name = "continuation"
        span = self._span(span_name, endpoint, name)
        started = self.clock()
        stream: ChunkStream | None = None
        backlog = 0
        if body.get("stream"):
            backlog = self._backlog(phase, body, stream=True)
            stream = await self._open_stream(endpoint, path, body, phase, span, headers, backlog)
            source: AsyncIterator[list[Json]] = stream
        else:
            source = _Whole(await self._post(endpoint, path, body, phase, name, span, headers))
        leg = Leg(endpoint, kind, source, stream is None, original_prompt, started, threshold)
        leg.phase = name
        leg.span = span
        if backlog:
            leg.backlog, leg.blocks, leg.on_answer = backlog, self.blocks, self._answered
        self._open.append((leg, stream))
        return leg

    async def _open_stream(
        self,
        endpoint: Endpoint,
        path: str,
        body: Json,
        phase: Phase,
        span: Span | None,
        extra: Mapping[str, str] | None,
        backlog: int,
    ) -> ChunkStream:
        """The stream answering ``body``, in flight on ``endpoint`` until it is closed."""
        blocks = self._enter(endpoint, backlog)
        try:
            stream = await self.upstream.open_stream(
                endpoint, path, self._encoded(body), phase=phase,
                headers=self._headers(endpoint, span, extra), prompt_tokens=self.prompt_tokens,
            )  # fmt: skip
        except BaseException as exc:
            self._abandon(endpoint, phase, span, backlog, blocks, exc)
            raise
        self.fleet.record_accepted(endpoint.name)
        return stream

    def answer(
        self,
        endpoint: Endpoint,
        answer: Json,
        kind: Kind,
        original_prompt: bool,
        threshold: float = 0.0,
    ) -> Leg:
        """A whole answer already in hand (accounted for when it was posted), as a leg."""
        leg = Leg(endpoint, kind, _Whole(answer), True, original_prompt, self.clock(), threshold)
        leg.phase = Phase.PREFILL if endpoint.role is Role.PREFILL else Phase.DECODE
        return leg

    async def lookup(self, endpoint: Endpoint, url: str) -> Any:
        """A connector's lookup about ``endpoint`` (``GET url``, a JSON answer)."""
        self.sent += 1
        try:
            return await self.upstream.get_json(endpoint, url)
        except UpstreamError as exc:
            self._failure(endpoint, exc, "lookup")
            raise

    def exclude(self, endpoint: str) -> None:
        """Leave ``endpoint`` out of this request's later choices, as if it had failed
        (a prefiller whose KV the failed decode leg may have lacked)."""
        self.failed.add(endpoint)

    def broken(self, endpoint: str) -> None:
        """A leg of ``endpoint`` broke mid-answer: the fleet stops choosing it."""
        self.failed.add(endpoint)
        self.fleet.mark_unhealthy(endpoint)

    async def close(self, leg: Leg) -> None:
        """Close ``leg`` (a stream's connection too, unless it was read to the end) and
        account for it."""
        if not leg.open:
            return
        leg.open = False
        for index, (open_leg, stream) in enumerate(self._open):
            if open_leg is leg:
                del self._open[index]
                if stream is None:  # a whole answer: read already, out of flight
                    self._closed(leg, True)
                    return
                try:
                    if stream.done:  # read to its end: the connection just goes back
                        await stream.aclose()
                    else:
                        with anyio.move_on_after(CLOSE_SECONDS, shield=True):
                            await stream.aclose()
                finally:
                    self.fleet.leave(leg.endpoint.name, leg.backlog, leg.blocks)
                    leg.backlog, leg.blocks = 0, ()
                    self._closed(leg, stream.done)
                return
        error = leg.take_error()
        if error is not None:  # an answer in hand (its leg was accounted) found faulty
            self._failure(leg.endpoint, error, leg.phase)

    def _closed(self, leg: Leg, done: bool) -> None:
        """Account for a leg that ended: read to its end (``done``: a stream's
        ``[DONE]``, or a whole answer), closed before it, or broken."""
        name = leg.endpoint.name
        error = leg.take_error()
        if error is not None:
            self._failed_leg(leg.endpoint, error, leg.phase, leg.span)
            return
        ended = done or leg.ended
        if leg.phase == "decode_attempt" and (ended or leg.decisive) and _rejects(leg.decisive):
            outcome = "rejected"
        else:
            outcome = "ok" if ended else "cancelled"
        if outcome != "cancelled":
            self.fleet.record_success(name)
        self.metrics.count_leg(name, leg.phase, outcome, self.clock() - leg.started)
        if leg.span is not None:
            attributes = _usage_attributes(leg.usage) | {"pd.completion_tokens": leg.tokens}
            RequestTrace.end_leg(leg.span, outcome, attributes)

    async def aclose(self) -> None:
        """Close every leg still open."""
        while self._open:
            await self.close(self._open[-1][0])


def _rejects(view: ChunkView | None) -> bool:
    """A decode attempt's first decisive part (None: a stream that ended with no
    choice) says ``cache_threshold`` without a token (as ``attempts.admits`` reads it)."""
    if view is None:
        return True
    return view.rejected and not view.token_ids and not view.completion_tokens


def _usage_attributes(usage: Any) -> dict[str, Any]:
    """Span attributes of an answer's usage: its token counts, when it reports them."""
    if not isinstance(usage, dict):
        return {}
    counts = (("pd.prompt_tokens", "prompt_tokens"), ("pd.completion_tokens", "completion_tokens"))
    return {key: usage[name] for key, name in counts if isinstance(usage.get(name), int)}
