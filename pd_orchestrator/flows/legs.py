"""Legs: the one way a flow opens or posts an upstream request.

A :class:`Legs` object belongs to one client request. Every upstream request of that
request goes through it, so every one is treated alike:

* counted in flight on its endpoint from the moment it is sent until it is read to
  the end or closed (a stream for as long as it streams);
* its success or failure reported to the fleet, when it is sent or, for a stream,
  when it fails mid-answer (:meth:`FleetState.record_error`: a connection that
  cannot be made counts as a failed check; outlier detection counts 5xx answers and
  broken connections); a leg the flow gives up on mid-answer marks its endpoint
  unhealthy (:meth:`Legs.broken`);
* its failures counted in ``pd_orchestrator_upstream_errors_total``;
* given an id (``X-Request-Id: <request id>-<n>``);
* closed when the request ends, whatever ends it (:meth:`Legs.aclose`, shielded and
  bounded).

A :class:`Leg` is an answer being read, in batches of chunks. A leg the client's
body asks to stream is read as SSE; otherwise its whole answer is the leg's one
batch (``whole``), so a flow relays both alike.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import anyio

from pd_orchestrator.fleet.endpoints import Endpoint
from pd_orchestrator.fleet.state import FleetState
from pd_orchestrator.flows.chunks import ChunkView, view_answer, view_chunk
from pd_orchestrator.openai.responses import Kind
from pd_orchestrator.telemetry.metrics import GatewayMetrics
from pd_orchestrator.upstream.client import ChunkStream, Phase, Upstream
from pd_orchestrator.upstream.errors import UpstreamError

__all__ = ["CLOSE_SECONDS", "Leg", "Legs"]

Json = dict[str, Any]
CLOSE_SECONDS = 2.0
"""How long closing one leg may take before it is abandoned."""


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
    ``tokens`` and ``usage``: what it generated and reported. ``error``: what broke
    it mid-answer (reported to the fleet when it is closed).
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
    error: UpstreamError | None = None

    def view(self, chunk: Json) -> ChunkView:
        """What ``chunk`` (an answer when ``whole``) says (read once per held chunk)."""
        views = self.views
        if views:
            seen = views.pop(id(chunk), None)
            if seen is not None:
                return seen
        return view_answer(chunk, self.kind) if self.whole else view_chunk(chunk, self.kind)

    async def read_until_decisive(self) -> ChunkView | None:
        """Hold chunks until one carries content or a finish; None if none does."""
        if self.decisive is not None:
            return self.decisive
        while (batch := await self._next()) is not None:
            self.held.extend(batch)
            for chunk in batch:
                view = self.view(chunk)
                self.views[id(chunk)] = view  # the relay reads it from here
                if view.decisive:
                    self.decisive = view
                    return view
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
            return None
        except UpstreamError as exc:
            self.error = exc
            raise


class Legs:
    """Every upstream request of one client request (see the module docstring)."""

    def __init__(
        self,
        upstream: Upstream,
        fleet: FleetState,
        metrics: GatewayMetrics,
        request_id: str,
        clock: Callable[[], float],
    ) -> None:
        self.upstream = upstream
        self.fleet = fleet
        self.metrics = metrics
        self.request_id = request_id
        self.clock = clock
        self.failed: set[str] = set()
        self._count = 0
        self._open: list[tuple[Leg, ChunkStream]] = []

    def next_id(self) -> str:
        """A new leg id: ``<request id>-<n>``."""
        self._count += 1
        return f"{self.request_id}-{self._count}"

    def _headers(self, extra: Mapping[str, str] | None) -> dict[str, str]:
        headers = {"x-request-id": self.next_id()}
        if extra:
            for name, value in extra.items():
                headers.pop(name.lower(), None)
                headers[name.lower()] = value
        return headers

    def _failure(self, endpoint: Endpoint, exc: UpstreamError) -> None:
        self.metrics.upstream_errors.labels(endpoint.name, type(exc).__name__).inc()
        self.failed.add(endpoint.name)
        self.fleet.record_error(endpoint.name, exc)

    async def post(
        self,
        endpoint: Endpoint,
        path: str,
        body: Json,
        phase: Phase,
        *,
        headers: Mapping[str, str] | None = None,
    ) -> Json:
        """POST ``body`` and return the whole answer (``headers`` add to or replace the
        leg's own, e.g. a connector's shared ``X-Request-Id``)."""
        fleet = self.fleet
        fleet.enter(endpoint.name)
        try:
            answer = await self.upstream.post_json(
                endpoint, path, body, phase=phase, headers=self._headers(headers)
            )
        except UpstreamError as exc:
            self._failure(endpoint, exc)
            raise
        finally:
            fleet.leave(endpoint.name)
        fleet.record_success(endpoint.name)
        return answer

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
        """Send ``body``: a stream when it says ``stream``, else a whole answer."""
        threshold = float(body.get("cache_hit_threshold") or 0.0)
        if not body.get("stream"):
            answer = await self.post(endpoint, path, body, phase, headers=headers)
            return self.answer(endpoint, answer, kind, original_prompt, threshold)
        started = self.clock()
        self.fleet.enter(endpoint.name)
        try:
            stream = await self.upstream.open_stream(
                endpoint, path, body, phase=phase, headers=self._headers(headers)
            )
        except UpstreamError as exc:
            self.fleet.leave(endpoint.name)
            self._failure(endpoint, exc)
            raise
        self.fleet.record_success(endpoint.name)
        leg = Leg(endpoint, kind, stream, False, original_prompt, started, threshold)
        self._open.append((leg, stream))
        return leg

    def answer(
        self,
        endpoint: Endpoint,
        answer: Json,
        kind: Kind,
        original_prompt: bool,
        threshold: float = 0.0,
    ) -> Leg:
        """A whole answer already in hand, as a leg."""
        return Leg(endpoint, kind, _Whole(answer), True, original_prompt, self.clock(), threshold)

    async def lookup(self, endpoint: Endpoint, url: str) -> Any:
        """A connector's lookup about ``endpoint`` (``GET url``, a JSON answer)."""
        try:
            return await self.upstream.get_json(endpoint, url)
        except UpstreamError as exc:
            self._failure(endpoint, exc)
            raise

    def broken(self, endpoint: str) -> None:
        """A leg of ``endpoint`` broke mid-answer: the fleet stops choosing it."""
        self.failed.add(endpoint)
        self.fleet.mark_unhealthy(endpoint)

    async def close(self, leg: Leg) -> None:
        """Close ``leg`` (its connection too, unless it was read to the end)."""
        if not leg.open:
            return
        leg.open = False
        for index, (open_leg, stream) in enumerate(self._open):
            if open_leg is leg:
                del self._open[index]
                try:
                    if stream.done:  # read to its end: the connection just goes back
                        await stream.aclose()
                    else:
                        with anyio.move_on_after(CLOSE_SECONDS, shield=True):
                            await stream.aclose()
                finally:
                    self.fleet.leave(leg.endpoint.name)
                    if leg.error is not None:
                        self._failure(leg.endpoint, leg.error)
                return

    async def aclose(self) -> None:
        """Close every leg still open."""
        while self._open:
            await self.close(self._open[-1][0])
