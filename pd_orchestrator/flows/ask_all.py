"""The ask-all flow: RFC 24256's "ask all K instances" routing.

``race`` (default): the request goes, with the threshold, to the K decoders the
plan ranks first (``ask_all.width``: all or K), all at once and always streamed
upstream so that admission is known at the first decisive chunk. The first decoder
to admit serves; every other leg is cancelled at once -- its upstream connection is
closed, which is how vLLM learns to abort it -- and nothing of it reaches the
client. Legs that admit after the winner are cancelled too.

``probe``: one-token probes go to the K decoders first; the real request then goes
to the admitting decoder that reported the most cached tokens (its cache is now
fully warm for the prompt). It costs one extra round trip and the prefill of every
admitting probe, and never two decoders generating the same answer.

All reject: one decoder is chosen by ``ask_all.fallback.pick`` among those asked
(least loaded, most free KV, or hardware weight; ties keep the plan's order) and
serves the request through the P/D flow with a prefiller of its compatibility
group, or locally with threshold 0 (``fallback.then: local``).

Hand-backs, recoveries, usage and headers work as in the decode-first flow, which
this flow extends; ``x-pd-decoder`` names the decoder that served.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import anyio
from anyio.streams.memory import MemoryObjectSendStream

from pd_orchestrator.config.settings import AskAllFallbackConfig
from pd_orchestrator.fleet.endpoints import Endpoint
from pd_orchestrator.flows.chunks import ChunkView, view_answer, view_chunk
from pd_orchestrator.flows.decode_first import DecodeFirstFlow, Json, _Leg
from pd_orchestrator.routing.types import Candidate
from pd_orchestrator.upstream.client import Phase
from pd_orchestrator.upstream.errors import UpstreamError

__all__ = ["AskAllFlow", "pick_fallback"]


@dataclass
class _Reply:
    """What one asked decoder did: ``admitted``, ``rejected``, ``cancelled`` or ``failed``."""

    decoder: Endpoint
    outcome: str
    leg: _Leg | None = None
    view: ChunkView | None = None


def _admits(view: ChunkView | None) -> bool:
    return view is not None and not (view.rejected and not view.token_ids)


def _fallback_key(candidate: Candidate, config: AskAllFallbackConfig) -> tuple[float, float]:
    load = candidate.load
    if config.pick == "most-free-kv":
        return (load.kv_usage if load is not None else math.inf, candidate.in_flight)
    if config.pick == "hardware-weight":
        weight = config.hardware_weights.get(candidate.endpoint.hardware, 1.0)
        return (-weight, candidate.in_flight)
    depth = load.queue_depth if load is not None else 0
    return (max(depth, candidate.in_flight), candidate.in_flight)


def pick_fallback(
    asked: Sequence[Endpoint], candidates: Sequence[Candidate], config: AskAllFallbackConfig
) -> Endpoint:
    """The decoder that takes a request every asked decoder rejected (pure).

    ``asked`` is in the plan's order, which breaks ties; candidates not asked are
    ignored, and an asked decoder without a candidate entry ranks last.
    """
    by_name = {c.endpoint.name: c for c in candidates}
    ranked = sorted(
        enumerate(asked),
        key=lambda item: (
            item[1].name not in by_name,
            _fallback_key(by_name[item[1].name], config) if item[1].name in by_name else (0, 0),
            item[0],
        ),
    )
    return ranked[0][1]


class AskAllFlow(DecodeFirstFlow):
    """Serves one request in ask-all mode; see the module docstring."""

    stream_legs = True

    def _asked(self) -> tuple[Endpoint, ...]:
        width = self.ctx.config.ask_all.width
        decoders = self.plan.decoders
        return decoders if width == "all" else decoders[:width]

    async def _attempt_stream(self) -> _Leg | None:
        asked = self._asked()
        started = self.ctx.clock()
        if self.ctx.config.ask_all.variant == "probe":
            winner = await self._probe(asked)
        else:
            winner = await self._race(asked)
        self._phase("decode_attempt", started)
        if winner is not None:
            self.ctx.metrics.ask_all.labels("admitted").inc()
            self.decoder = winner.endpoint
            return winner
        return await self._fallback(asked)

    # -- race ------------------------------------------------------------------------------
    async def _race(self, asked: Sequence[Endpoint]) -> _Leg | None:
        body = self._leg_body(self.plan.threshold.value)
        send, receive = anyio.create_memory_object_stream[_Reply](len(asked))
        scopes = {decoder.name: anyio.CancelScope() for decoder in asked}
        winner: _Leg | None = None
        async with anyio.create_task_group() as tg, receive:
            for decoder in asked:
                tg.start_soon(self._ask, decoder, body, scopes[decoder.name], send.clone())
            send.close()
            async for reply in receive:
                if reply.outcome == "admitted" and winner is None:
                    winner = reply.leg
                    for name, scope in scopes.items():
                        if name != reply.decoder.name:
                            scope.cancel()
                elif reply.outcome == "admitted":
                    reply.outcome = "cancelled"
                await self._settle(reply, keep=reply.leg is winner)
        return winner

    async def _ask(
        self,
        decoder: Endpoint,
        body: Json,
        scope: anyio.CancelScope,
        results: MemoryObjectSendStream[_Reply],
    ) -> None:
        reply = _Reply(decoder, "cancelled")
        with results, scope:
            try:
                reply.leg = await self._open_leg(
                    decoder, self.request.path, body, Phase.DECODE_ATTEMPT, self.request.kind
                )
                reply.view = await self._read_until_decisive(reply.leg)
                reply.outcome = "admitted" if _admits(reply.view) else "rejected"
            except UpstreamError:
                self.ctx.fleet.record_failure(decoder.name)
                reply.outcome = "failed"
            finally:
                results.send_nowait(reply)

    async def _settle(self, reply: _Reply, *, keep: bool) -> None:
        """Count one leg's outcome; close every leg but the winner's."""
        self.ctx.metrics.fanout_legs.labels(reply.outcome).inc()
        if reply.leg is None or keep:
            return
        if reply.outcome == "cancelled":
            kind = reply.leg.kind
            wasted = sum(len(view_chunk(c, kind).token_ids or ()) for c in reply.leg.held)
            self.ctx.metrics.fanout_wasted_tokens.inc(wasted)
        await self._discard(reply.leg)

    # -- probe -----------------------------------------------------------------------------
    async def _probe(self, asked: Sequence[Endpoint]) -> _Leg | None:
        body = _one_token(self._leg_body(self.plan.threshold.value))
        answers: dict[str, Json | None] = {}

        async def probe(decoder: Endpoint) -> None:
            try:
                answers[decoder.name] = await self._post(
                    decoder, self.request.path, body, Phase.DECODE_ATTEMPT
                )
            except UpstreamError:
                answers[decoder.name] = None

        async with anyio.create_task_group() as tg:
            for decoder in asked:
                tg.start_soon(probe, decoder)
        chosen = self._best_probe(asked, answers)
        if chosen is None:
            return None
        self.decoder = chosen
        leg = await self._open_leg(
            chosen, self.request.path, self._leg_body(self.plan.threshold.value),
            Phase.DECODE_ATTEMPT, self.request.kind,
        )  # fmt: skip
        if not _admits(await self._read_until_decisive(leg)):
            await self._discard(leg)
            return None
        return leg

    def _best_probe(
        self, asked: Sequence[Endpoint], answers: dict[str, Json | None]
    ) -> Endpoint | None:
        """The admitting decoder with the most cached tokens (ties: the plan's order).

        Counts every probe's outcome; each admitting probe that is not chosen
        wasted its token (and its prefill).
        """
        admitted: list[tuple[int, int, Endpoint]] = []
        for order, decoder in enumerate(asked):
            answer = answers.get(decoder.name)
            view = None if answer is None else view_answer(answer, self.request.kind)
            outcome = "failed" if view is None else "admitted" if _admits(view) else "rejected"
            self.ctx.metrics.fanout_legs.labels(outcome).inc()
            if view is not None and outcome == "admitted":
                admitted.append((-_cached_tokens(view), order, decoder))
        if not admitted:
            return None
        self.ctx.metrics.fanout_wasted_tokens.inc(len(admitted) - 1)
        return min(admitted, key=lambda item: (item[0], item[1]))[2]

    # -- all rejected --------------------------------------------------------------------------
    async def _fallback(self, asked: Sequence[Endpoint]) -> _Leg | None:
        config = self.ctx.config.ask_all.fallback
        self.decoder = pick_fallback(asked, self.ctx.candidates(), config)
        if config.then == "pd":
            self.ctx.metrics.ask_all.labels("fallback_pd").inc()
            return None
        self.ctx.metrics.ask_all.labels("fallback_local").inc()
        leg = await self._open_leg(
            self.decoder, self.request.path, self._leg_body(0.0), Phase.DECODE, self.request.kind
        )
        await self._read_until_decisive(leg)
        return leg


def _cached_tokens(view: ChunkView) -> int:
    usage = view.usage or {}
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return cached if isinstance(cached, int) else 0


def _one_token(body: Json) -> Json:
    """A probe: the attempt body, not streamed, one token."""
    probe = {k: v for k, v in body.items() if k != "stream_options"}
    probe["stream"] = False
    probe["max_tokens"] = 1
    if "max_completion_tokens" in probe:
        probe["max_completion_tokens"] = 1
    if "min_tokens" in probe:
        probe["min_tokens"] = min(1, int(probe["min_tokens"] or 0))
    return probe
