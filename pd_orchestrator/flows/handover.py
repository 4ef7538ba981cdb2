"""The P/D leg: prefill on a prefiller, the KV handed to the decoder, decode there.

One hand-over, as its KV connector says (:mod:`connectors`), for the first rejection
and for every continuation alike:

1. **Context**: a fresh transfer id, the leg id both legs may share, and both peers'
   connector addresses (configured ``kv`` blocks, updated by what earlier answers
   and lookups taught about each prefiller: :meth:`FleetState.learned`).
2. **Lookups** the connector still needs (Mooncake's bootstrap ``/query`` for an
   engine id nobody configured), run through the legs; what they return is kept.
3. **Legs**, in the connector's order:

   * ``SEQUENTIAL``: the prefill leg, its answer read (:meth:`read_prefill`), then
     the decode leg with the transfer params;
   * ``TOGETHER``: both legs at once, the decode leg built from what is known ahead
     (``ahead_params``) and read only to its first decisive chunk, held, until the
     prefill answered; a finished prefill or a stale context closes it (the latter
     sends the decode leg again with the answer's params), a failed prefill closes
     it and fails the attempt.

   A prefill answer without transfer params that finished is itself the answer.
   Transfer params that name a host the prefiller cannot be reached at (its URL's
   or ``kv`` host, or what those resolve to) are the prefiller's protocol error:
   a decoder never connects where an upstream alone says.
4. **Retries**: an attempt that fails on the prefill side (a broken or refused
   connection, a timeout, or a 5xx) is retried on the next prefiller, chosen when the
   retry starts: the best of the plan's not seen failing in this request and in
   routing (healthy, not ejected), else the best not seen failing, else one not yet
   tried, else the next in turn. Each retry waits a full-jitter exponential backoff
   first; at most ``upstream.prefill_attempts`` attempts, all within
   ``upstream.prefill_budget`` seconds plus the prompt's read-timeout allowance
   (:meth:`Legs.allowance`), which also bounds each prefill leg. A 4xx
   (the request itself is refused) is not retried, nor is a failure of the decode
   leg (the flow handles that).
"""

from __future__ import annotations

import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception, wait_random_exponential

from connectors import (
    Connector,
    ConnectorError,
    LegOrder,
    PeerInfo,
    PrefillOutcome,
    TransferContext,
    named_hosts,
)
from connectors import Leg as Side
from pd_orchestrator.config.settings import UpstreamConfig
from pd_orchestrator.flows.bodies import with_threshold
from pd_orchestrator.flows.legs import Leg, Legs
from pd_orchestrator.flows.sink import GatewayError
from pd_orchestrator.model.endpoints import Endpoint
from pd_orchestrator.model.records import record
from pd_orchestrator.openai.responses import Kind, cached_count
from pd_orchestrator.planner.choices import next_prefiller
from pd_orchestrator.upstream.client import Phase
from pd_orchestrator.upstream.errors import (
    UpstreamError,
    UpstreamProtocolError,
    UpstreamTimeout,
)

__all__ = ["Handover", "HandoverResult", "retryable"]

Json = dict[str, Any]
_MAX_BACKOFF = 2.0
"""Seconds the backoff between two prefill attempts is at most."""


def retryable(exc: BaseException) -> bool:
    """Whether another endpoint may succeed where this failure happened (the error's
    own :attr:`~pd_orchestrator.upstream.errors.UpstreamError.retryable`)."""
    return isinstance(exc, UpstreamError) and exc.retryable


@record
class _Shape:
    """What both legs carry: the body (with its threshold), path and API, and whether
    it serves the client's own prompt."""

    body: Json
    path: str
    kind: Kind
    original_prompt: bool

    @property
    def threshold(self) -> float:
        return float(self.body.get("cache_hit_threshold") or 0.0)


@record
class HandoverResult:
    """The leg that serves (the decode leg, or the prefill's finished answer) and the
    prefiller that prefilled."""

    leg: Leg
    prefiller: Endpoint


@dataclass(slots=True)
class Handover:
    """One P/D leg of one request (see the module docstring). ``prefiller``: the last
    prefiller tried (set while it runs, so a caller can name it after a failure)."""

    legs: Legs
    connector: Connector
    decoder: Endpoint
    prefillers: tuple[Endpoint, ...]
    config: UpstreamConfig
    clock: Callable[[], float]
    kv_source: PeerInfo | None = None
    prefiller: Endpoint | None = field(default=None, init=False)
    sent: float | None = field(default=None, init=False)
    """When the last prefill leg was sent (the clock's; None: none was)."""
    answered: float | None = field(default=None, init=False)
    """When the last prefill answer came (the clock's; None: none came)."""
    prefill_cached: int | None = field(default=None, init=False)
    """The prompt tokens the prefiller reported cached in its answer (None: not said)."""
    _deadline: float = field(default=0.0, init=False)

    async def run(
        self, body: Json, path: str, kind: Kind, *, original_prompt: bool
    ) -> HandoverResult:
        """Prefill ``body`` and decode it on the decoder with the threshold it carries.

        When it ends, nothing of it is left in a reference cycle (tenacity's kept actions,
        the last failure's traceback through tenacity's frame): the hand-over, its legs
        and the request's body are freed then, not at a full collection, which the
        gateway's collector thresholds make rare."""
        shape = _Shape(body, path, kind, original_prompt)
        deadline = self.clock() + self.config.prefill_budget + self.legs.allowance()
        retrying = self._retrying(deadline)
        try:
            return await retrying(self._attempt, shape, deadline, [])
        except BaseException as exc:
            # its traceback holds tenacity's finished frame, which holds it
            traceback.clear_frames(exc.__traceback__)
            raise
        finally:
            retrying.iter_state.reset()  # its last actions: methods of itself

    async def _attempt(self, shape: _Shape, deadline: float, tried: list[str]) -> HandoverResult:
        """One prefill attempt, on the next prefiller (:meth:`_next`)."""
        prefiller = self.prefiller = self._next(tried)
        tried.append(prefiller.name)
        return HandoverResult(await self._once(prefiller, shape, deadline), prefiller)

    def _retrying(self, deadline: float) -> AsyncRetrying:
        """The prefill attempts: another after a retryable failure of the prefiller
        itself (not the request's own fault, not the decode leg's), at most
        ``prefill_attempts``, each after a full-jitter exponential backoff (uniform in
        [0, ``retry_backoff`` * 2**(n-1)], at most 2 s) that must end before
        ``deadline``; the last failure is raised as it is."""
        config = self.config

        def prefiller_failed(exc: BaseException) -> bool:
            prefiller = self.prefiller
            return (
                isinstance(exc, UpstreamError)
                and exc.retryable
                and prefiller is not None
                and exc.endpoint == prefiller.name
            )

        def spent(state: RetryCallState) -> bool:
            return (
                state.attempt_number >= config.prefill_attempts
                or self.clock() + state.upcoming_sleep >= deadline
            )

        return AsyncRetrying(
            retry=retry_if_exception(prefiller_failed),
            wait=wait_random_exponential(multiplier=config.retry_backoff, max=_MAX_BACKOFF),
            stop=spent,
            sleep=anyio.sleep,
            reraise=True,
        )

    def _next(self, tried: list[str]) -> Endpoint:
        """The plan's choice of prefiller for the next attempt
        (:func:`~pd_orchestrator.planner.choices.next_prefiller`); 503 when the decoder
        has no compatible prefiller."""
        found = next_prefiller(self.prefillers, tried, self.legs.failed, self.legs.fleet)
        if found is None:
            raise GatewayError(503, f"no prefiller can hand KV over to decoder {self.decoder.name}")
        return found

    async def _once(self, prefiller: Endpoint, shape: _Shape, deadline: float) -> Leg:
        ctx = await self._context(prefiller)
        self._deadline = deadline
        started = self.clock()
        if self.connector.order(ctx) is LegOrder.TOGETHER:
            leg = await self._together(prefiller, ctx, shape)
        else:
            leg = await self._sequential(prefiller, ctx, shape)
        self.legs.metrics.observe_phase("prefill", self.clock() - started)
        return leg

    async def _context(self, prefiller: Endpoint) -> TransferContext:
        fleet = self.legs.fleet
        ctx = TransferContext(
            request_id=self.legs.next_id(),
            transfer_id=uuid.uuid4().hex,
            prefiller=prefiller.peer.updated(fleet.learned(prefiller.name)),
            decoder=self.decoder.peer.updated(fleet.learned(self.decoder.name)),
            kv_source=self.kv_source,
        )
        for lookup in self.connector.lookups(ctx):
            peer = prefiller if lookup.leg is Side.PREFILL else self.decoder
            update = lookup.parse(await self.legs.lookup(peer, lookup.url))
            fleet.learn(peer.name, update)
            ctx = ctx.with_peer(lookup.leg, update)
        return ctx

    async def _prefill(self, prefiller: Endpoint, ctx: TransferContext, shape: _Shape) -> Json:
        """The prefill leg, within what is left of the prefill budget."""
        connector = self.connector
        self.sent = self.clock()
        left = self._deadline - self.sent
        try:
            with anyio.fail_after(max(left, 0.0)):
                return await self.legs.post(
                    prefiller,
                    shape.path,
                    connector.prefill_body(shape.body, ctx),
                    Phase.PREFILL,
                    headers=connector.headers(Side.PREFILL, ctx),
                )
        except TimeoutError:
            raise UpstreamTimeout(
                prefiller.name, Phase.PREFILL, "prefill budget exhausted", role="prefiller"
            ) from None

    async def _read(
        self, prefiller: Endpoint, answer: Json, ctx: TransferContext
    ) -> PrefillOutcome:
        """What the prefill answer means for the decode leg (see :meth:`_checked`)."""
        self.answered = self.clock()
        self.prefill_cached = cached_count(answer.get("usage"))
        try:
            outcome = self.connector.read_prefill(answer, ctx)
        except ConnectorError as exc:
            raise self._refused(prefiller, str(exc)) from exc
        outcome = await self._checked(prefiller, outcome)
        if outcome.learned is not None:
            self.legs.fleet.learn(prefiller.name, outcome.learned)
        return outcome

    async def _checked(self, prefiller: Endpoint, outcome: PrefillOutcome) -> PrefillOutcome:
        """``outcome`` when every host its params name (:func:`connectors.named_hosts`) is
        one the prefiller may be reached at (:meth:`Upstream.addresses`); else the
        prefiller's protocol error: the decoder never connects where a prefiller says
        unless the configuration (or the allow-list a sidecar checked the prefiller
        against) named that host."""
        try:
            hosts = named_hosts(self.connector.describe(), outcome.params)
        except ConnectorError as exc:
            raise self._refused(prefiller, str(exc)) from exc
        upstream = self.legs.upstream
        if any(host not in upstream.hosts_of(prefiller) for host in hosts):
            allowed = await upstream.addresses(prefiller)  # resolves names (cached)
            for host in hosts:
                if host not in allowed:
                    raise self._refused(prefiller, f"transfer params name host {host!r}")
        return outcome

    def _refused(self, prefiller: Endpoint, why: str) -> UpstreamError:
        """The prefiller's protocol error for unusable transfer params, counted against
        it (metrics, outlier detection) and logged."""
        return self.legs.faulted(
            prefiller,
            UpstreamProtocolError(
                prefiller.name, Phase.PREFILL, f"unusable transfer params ({why})", role="prefiller"
            ),
        )

    async def _decode(
        self, ctx: TransferContext, shape: _Shape, params: dict[str, Any] | None
    ) -> Leg:
        connector = self.connector
        decode = with_threshold(connector.decode_body(shape.body, params, ctx), shape.threshold)
        return await self.legs.open(
            self.decoder,
            shape.path,
            decode,
            Phase.DECODE,
            kind=shape.kind,
            original_prompt=shape.original_prompt,
            headers=connector.headers(Side.DECODE, ctx),
        )

    async def _sequential(self, prefiller: Endpoint, ctx: TransferContext, shape: _Shape) -> Leg:
        answer = await self._prefill(prefiller, ctx, shape)
        outcome = await self._read(prefiller, answer, ctx)
        if outcome.params is None and outcome.finished:
            return self.legs.answer(prefiller, answer, shape.kind, shape.original_prompt)
        return await self._decode(ctx, shape, outcome.params)

    async def _together(self, prefiller: Endpoint, ctx: TransferContext, shape: _Shape) -> Leg:
        ahead = self.connector.ahead_params(ctx)
        held: list[Leg] = []
        failures: list[BaseException] = []

        async def decode(scope: anyio.CancelScope) -> None:
            with scope:
                try:
                    leg = await self._decode(ctx, shape, ahead)
                    held.append(leg)
                    await leg.read_until_decisive()
                except UpstreamError as exc:
                    failures.append(exc)

        scope = anyio.CancelScope()
        answer: Json | None = None
        outcome: PrefillOutcome | None = None
        async with anyio.create_task_group() as tg:
            tg.start_soon(decode, scope)
            try:
                answer = await self._prefill(prefiller, ctx, shape)
                outcome = await self._read(prefiller, answer, ctx)
            except UpstreamError as exc:
                failures.insert(0, exc)
            if outcome is None or outcome.finished or outcome.stale:
                scope.cancel()  # the decoder would wait for KV that is not coming
        if answer is None or outcome is None:
            await self._close(held)
            raise failures[0]
        if outcome.finished:
            await self._close(held)
            return self.legs.answer(prefiller, answer, shape.kind, shape.original_prompt)
        if outcome.stale or failures:
            await self._close(held)
            if outcome.stale:
                self.legs.fleet.forget(prefiller.name)
                return await self._decode(ctx, shape, outcome.params)
            raise failures[0]
        return held[0]

    async def _close(self, held: list[Leg]) -> None:
        for leg in held:
            await self.legs.close(leg)
