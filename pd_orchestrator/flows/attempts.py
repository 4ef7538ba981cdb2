"""How a flow asks decoders first: one at a time, all at once, or probes first.

An attempt sends the client's request, with the plan's threshold, to the decoders
the plan asks (``plan.asked``) and returns an :class:`Attempted`: the decoder that
admitted it and its leg, read up to its first decisive chunk; or, when every decoder
rejected, the decoder that takes the request now (through P/D, or ``local``: on its
own with threshold 0).

* :class:`Single` (decode-first): the plan's first decoder; its answer decides. (When
  it fails, the flow starts over with the plan's next decoder.) At threshold 1 it is
  not asked: no prompt reaches a hit ratio of 1 (vLLM computes a prompt's last token
  whatever it holds), so the request goes straight to P/D on it, without the attempt's
  leg and its wait in the decoder's queue.
* :class:`Race` (ask-all): every asked decoder at once, always streamed, so admission
  is known at the first decisive chunk. The first to admit serves; every other leg is
  closed at once (closing the connection is how vLLM aborts) and nothing of it reaches
  the client.
* :class:`Probe` (ask-all): one-token probes to every asked decoder, then the real
  request to the admitting decoder that reported the most cached tokens.

At threshold 1 the ask-all attempts ask no decoder either (as :class:`Single`): the
request goes straight to the fallback decoder through P/D (counted as ``skipped``).
With ``width: adaptive`` the plan may ask no decoder (no decoder is likely to hold
the prompt): the ask-all attempts then skip the fan-out and go straight to the
fallback (counted as ``skipped``). Every ask-all request counts how many decoders it
asked (``pd_orchestrator_ask_all_asked``) and why (``pd_orchestrator_ask_all_width_total``).

Tokenize once: when an ask-all request asks at least ``ask_all.tokenize_from``
decoders and may go as token ids (:attr:`~pd_orchestrator.flows.request.ClientRequest.tokenizable`),
:meth:`Attempt.prompt_ids` gives its prompt's token ids -- the ones the gateway has,
or one ``/tokenize`` on one of the asked decoders (they take turns, by the request's
ordinal) -- and every leg of the original prompt sends them
(:class:`~pd_orchestrator.flows.bodies.Route`), so no asked decoder tokenizes the
prompt again. A ``/tokenize`` that fails or times out costs only the
time it took: the prompt goes as text.

When every asked decoder rejects, the plan chooses one
(:meth:`~pd_orchestrator.planner.plan.Plan.fallback`: least loaded, most free KV or
hardware weight, from the plan's snapshot); equals take turns with the request's
ordinal, so requests that tie spread over the tied decoders.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, assert_never

import anyio
from anyio.streams.memory import MemoryObjectSendStream

from pd_orchestrator.config.settings import AskAllConfig
from pd_orchestrator.flows.bodies import Route
from pd_orchestrator.flows.chunks import ChunkView, MalformedChunk, view_answer
from pd_orchestrator.flows.legs import Leg, Legs
from pd_orchestrator.flows.request import ClientRequest
from pd_orchestrator.flows.sink import check_token_ids
from pd_orchestrator.model.endpoints import Endpoint
from pd_orchestrator.model.records import record
from pd_orchestrator.model.route import Ask, Decline, GoPD, Local, Whole
from pd_orchestrator.openai.responses import Kind, cached_count
from pd_orchestrator.openai.tokenize import token_ids, tokenize_body
from pd_orchestrator.planner.plan import Plan
from pd_orchestrator.telemetry.metrics import GatewayMetrics
from pd_orchestrator.upstream.client import Phase
from pd_orchestrator.upstream.errors import UpstreamError

__all__ = [
    "Attempt",
    "Attempted",
    "Probe",
    "Race",
    "Single",
    "admits",
    "attempt_for",
]

Json = dict[str, Any]


@record
class Attempted:
    """What the attempt found: ``leg`` is the admitting decoder's answer, or None when
    every asked decoder rejected and ``decoder`` takes the request (``local``: with
    threshold 0 on its own, else through P/D); ``rejected``: the decoders that
    rejected the request at its threshold."""

    decoder: Endpoint
    leg: Leg | None
    local: bool = False
    rejected: tuple[str, ...] = ()


class Attempt(Protocol):
    """One way to ask the decoders first (see the module docstring)."""

    streams: bool
    """Whether decoder legs must stream even for a client that wants a whole answer."""

    async def prompt_ids(self, request: ClientRequest, plan: Plan, legs: Legs) -> list[int] | None:
        """The prompt's token ids when the original prompt's legs send them instead of
        the client's prompt (None: as the client sent it)."""
        ...

    async def run(self, route: Route, plan: Plan, legs: Legs, body: Json) -> Attempted:
        """Ask the decoders with ``body`` (the original prompt's body, on ``route``,
        with the threshold)."""
        ...


def admits(view: ChunkView | None) -> bool:
    """Whether an answer's first decisive part says the decoder took the request."""
    if view is None:
        return False  # a stream that ended with no choice: rejected with no token
    return not (view.rejected and not view.token_ids and not view.completion_tokens)


class Single:
    """Decode-first: the plan's first decoder."""

    streams = False

    async def prompt_ids(self, request: ClientRequest, plan: Plan, legs: Legs) -> list[int] | None:
        return None  # one decoder tokenizes it once

    async def run(self, route: Route, plan: Plan, legs: Legs, body: Json) -> Attempted:
        decoder = plan.asked[0]
        match plan.route:
            case GoPD() | Decline():  # no decoder admits it: straight to P/D
                return Attempted(decoder, None)
            case Ask() | Local() | Whole():
                pass
            case _:
                assert_never(plan.route)
        leg = await legs.open(decoder, route.path, body, Phase.DECODE_ATTEMPT, kind=route.kind)
        if admits(await leg.read_until_decisive()):
            return Attempted(decoder, leg)
        await legs.close(leg)
        return Attempted(decoder, None, rejected=(decoder.name,))


# -- ask-all -----------------------------------------------------------------------------------
@dataclass
class _Reply:
    """What one asked decoder did: ``admitted``, ``rejected``, ``cancelled`` or ``failed``."""

    decoder: Endpoint
    outcome: str
    leg: Leg | None = None


class _AskAll:
    """What the ask-all attempts share: settings, metrics and the fallback."""

    streams = True

    def __init__(
        self, config: AskAllConfig, metrics: GatewayMetrics, max_ids: int | None = None
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.max_ids = max_ids

    async def prompt_ids(self, request: ClientRequest, plan: Plan, legs: Legs) -> list[int] | None:
        """Token ids when ``plan`` asks at least ``tokenize_from`` decoders (see the
        module docstring); counted by how the prompt goes. Held to ``max_ids`` as a
        client's token ids are (400)."""
        asked = _asked(plan)
        least = self.config.tokenize_from
        if least is None or len(asked) < least:
            return None
        counted = self.metrics.ask_all_prompts
        if not request.tokenizable:
            counted.labels("text").inc()
            return None
        if request.prompt_ids is not None:
            counted.labels("reused").inc()
            ids: list[int] | None = list(request.prompt_ids)
        else:  # the asked decoders take turns tokenizing (no hot spot)
            ids = await self._tokenize(request, asked[plan.ordinal % len(asked)], legs)
            counted.labels("failed" if ids is None else "tokenized").inc()
        if ids is not None and self.max_ids is not None:
            check_token_ids(len(ids), self.max_ids)
        return ids

    async def _tokenize(
        self, request: ClientRequest, decoder: Endpoint, legs: Legs
    ) -> list[int] | None:
        """The prompt's ids from ``decoder``'s ``/tokenize`` (None: it failed)."""
        body = tokenize_body(request.body, chat=request.kind == "chat")
        if body is None:
            return None
        with anyio.move_on_after(self.config.tokenize_timeout):
            try:
                return token_ids(await legs.post(decoder, "/tokenize", body, Phase.TOKENIZE))
            except UpstreamError:
                return None
        return None

    def _asking(self, plan: Plan) -> tuple[Endpoint, ...]:
        """The decoders ``plan`` asks, counted (how many, and why)."""
        asked = _asked(plan)
        self.metrics.ask_all_asked.observe(len(asked))
        self.metrics.ask_all_width.labels(plan.width.reason if plan.width else "fixed").inc()
        return asked

    def _won(self, leg: Leg) -> Attempted:
        self.metrics.ask_all.labels("admitted").inc()
        return Attempted(leg.endpoint, leg)

    def _fell_back(self, plan: Plan, rejected: tuple[str, ...]) -> Attempted:
        """The fallback decoder takes the request; at threshold 1 (no decoder asked)
        through P/D, as decode-first sends it."""
        config = self.config.fallback
        decoder = plan.fallback(config)
        asked = _asked(plan)
        local = config.then == "local" and not _admits_none(plan)
        outcome = "skipped" if not asked else "fallback_local" if local else "fallback_pd"
        self.metrics.ask_all.labels(outcome).inc()
        return Attempted(decoder, None, local=local, rejected=rejected)


class Race(_AskAll):
    """Ask-all: every asked decoder at once; the first to admit serves."""

    async def run(self, route: Route, plan: Plan, legs: Legs, body: Json) -> Attempted:
        asked = self._asking(plan)
        if not asked:
            return self._fell_back(plan, ())
        send, receive = anyio.create_memory_object_stream[_Reply](len(asked))
        scopes = {decoder.name: anyio.CancelScope() for decoder in asked}
        winner: Leg | None = None
        rejected: list[str] = []
        async with anyio.create_task_group() as tg, receive:
            for decoder in asked:
                ask = (route, legs, decoder, body, scopes[decoder.name], send.clone())
                tg.start_soon(self._ask, *ask)
            send.close()
            async for reply in receive:
                if reply.outcome == "admitted" and winner is None:
                    winner = reply.leg
                    for name, scope in scopes.items():
                        if name != reply.decoder.name:
                            scope.cancel()
                elif reply.outcome == "admitted":
                    reply.outcome = "cancelled"
                elif reply.outcome == "rejected":
                    rejected.append(reply.decoder.name)
                await self._settle(legs, reply, keep=reply.leg is winner)
        if winner is not None:
            return self._won(winner)
        return self._fell_back(plan, tuple(rejected))

    async def _ask(
        self,
        route: Route,
        legs: Legs,
        decoder: Endpoint,
        body: Json,
        scope: anyio.CancelScope,
        results: MemoryObjectSendStream[_Reply],
    ) -> None:
        reply = _Reply(decoder, "cancelled")
        with results, scope:
            try:
                reply.leg = await legs.open(
                    decoder, route.path, body, Phase.DECODE_ATTEMPT, kind=route.kind
                )
                admitted = admits(await reply.leg.read_until_decisive())
                reply.outcome = "admitted" if admitted else "rejected"
            except UpstreamError:
                reply.outcome = "failed"
            finally:
                results.send_nowait(reply)

    async def _settle(self, legs: Legs, reply: _Reply, *, keep: bool) -> None:
        """Count one leg's outcome; close every leg but the winner's."""
        self.metrics.fanout_legs.labels(reply.outcome).inc()
        leg = reply.leg
        if leg is None or keep:
            return
        if reply.outcome == "cancelled":
            self.metrics.fanout_wasted_tokens.inc(_held_tokens(leg))
        await legs.close(leg)


def _asked(plan: Plan) -> tuple[Endpoint, ...]:
    """The decoders an ask-all attempt asks: the plan's, none at threshold 1 (as
    :class:`Single`: no prompt reaches a hit ratio of 1, so asking only costs time)."""
    return () if _admits_none(plan) else plan.asked


def _admits_none(plan: Plan) -> bool:
    """Whether ``plan``'s route sends threshold 1 (P/D now, or declined): no decoder
    admits it."""
    return isinstance(plan.route, GoPD | Decline)


def _held_tokens(leg: Leg) -> int:
    """Tokens in the chunks ``leg`` holds (none counted past a malformed one, which is
    the leg's fault, reported when it is closed)."""
    tokens = 0
    try:
        for chunk in leg.held:
            tokens += len(leg.view(chunk).token_ids or ())
    except UpstreamError:
        pass
    return tokens


class Probe(_AskAll):
    """Ask-all: one-token probes first, then the admitting decoder with the most cache."""

    async def run(self, route: Route, plan: Plan, legs: Legs, body: Json) -> Attempted:
        asked = self._asking(plan)
        if not asked:
            return self._fell_back(plan, ())
        probe_body = _one_token(body)
        answers: dict[str, Json | None] = {}

        async def probe(decoder: Endpoint) -> None:
            try:
                answers[decoder.name] = await legs.post(
                    decoder, route.path, probe_body, Phase.DECODE_ATTEMPT, label="probe"
                )
            except UpstreamError:
                answers[decoder.name] = None

        async with anyio.create_task_group() as tg:
            for decoder in asked:
                tg.start_soon(probe, decoder)
        chosen, rejected = self._best(route.kind, asked, answers)
        if chosen is None:
            return self._fell_back(plan, rejected)
        leg = await legs.open(chosen, route.path, body, Phase.DECODE_ATTEMPT, kind=route.kind)
        if not admits(await leg.read_until_decisive()):
            await legs.close(leg)
            return self._fell_back(plan, (*rejected, chosen.name))
        return self._won(leg)

    def _best(
        self, kind: Kind, asked: Sequence[Endpoint], answers: dict[str, Json | None]
    ) -> tuple[Endpoint | None, tuple[str, ...]]:
        """The admitting decoder with the most cached tokens (ties: the plan's order),
        and the decoders whose probe was rejected.

        Counts every probe's outcome; each admitting probe that is not chosen wasted
        its token (and its prefill).
        """
        admitted: list[tuple[int, int, Endpoint]] = []
        rejected: list[str] = []
        for order, decoder in enumerate(asked):
            view = _probe_view(answers.get(decoder.name), kind)
            outcome = "failed" if view is None else "admitted" if admits(view) else "rejected"
            self.metrics.fanout_legs.labels(outcome).inc()
            if view is not None and outcome == "admitted":
                admitted.append((-(cached_count(view.usage) or 0), order, decoder))
            elif outcome == "rejected":
                rejected.append(decoder.name)
        if not admitted:
            return None, tuple(rejected)
        self.metrics.fanout_wasted_tokens.inc(len(admitted) - 1)
        return min(admitted, key=lambda item: (item[0], item[1]))[2], tuple(rejected)


def _probe_view(answer: Json | None, kind: Kind) -> ChunkView | None:
    """What a probe's answer says (None: it failed, or its answer is malformed)."""
    if answer is None:
        return None
    try:
        return view_answer(answer, kind)
    except MalformedChunk:
        return None


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


def attempt_for(mode: str, ask_all: AskAllConfig, metrics: GatewayMetrics, max_ids: int) -> Attempt:
    """The attempt strategy of a gateway ``mode`` (``decode-first`` or ``ask-all``);
    ``max_ids``: the most token ids a prompt may be (``limits.max_prompt_token_ids``)."""
    if mode != "ask-all":
        return Single()
    if ask_all.variant == "probe":
        return Probe(ask_all, metrics, max_ids)
    return Race(ask_all, metrics, max_ids)
