"""``goodput``: prefill where the request meets its SLO at the least cost to everyone else.

The decision reads the cost model (:class:`~pd_orchestrator.policies.goodput_model.GoodputModel`,
whose module docstring states the estimates, the hop terms and the learning rule) and
changes nothing; the planner tells the model what the request's final route kept
(:meth:`GoodputPolicy.chosen`). For the chosen decoder ``d``, in this order:

1. **spill** (a prefill pool whose ``spill`` is set): if ``d`` is *crowded* (its decode
   step with one more stream exceeds ``tpot * tpot_goal``) or *queued* (``wait_d + h >=
   T * s``), serve the request whole on the compatible spilling prefiller that answers
   soonest (``whole_p + h <= T``, and a shorter step than ``d``'s, or for a queued ``d``
   an answer before ``wait_d``; ties to the shorter step): :class:`Whole`, ``spill``.
2. **drain**: a queued ``d`` with a dedicated prefiller (role ``prefill``) goes P/D at
   once when ``remote <= T`` and (``remote <= wait_d + local`` or ``wait_d + local >
   T``); on an unread hit rate, only when ``remote <= min(wait_d + local, T * s)``. The
   decode leg goes to the peer with the least prefill queued that is not crowded
   (:meth:`soonest`):
   :class:`GoPD`, ``drain``. Otherwise a queued ``d`` keeps the prompt: :class:`Local`,
   ``queued``.
3. **threshold**: ``u* = min(ttft limit, stall_d)``, the ttft limit being what a local
   prefill does within ``max(remote - h, T * s - wait_d - h)`` with a dedicated
   prefiller, else within ``T - wait_d - h`` (everything when ``wait_d + remote > T``);
   the stall bound applies when a dedicated prefiller answers within ``T`` (``wait_d +
   remote <= T``; within ``T * s`` beside a spilling prefiller, whose prefills stall the
   streams it serves whole), and when the prompt kept local would miss ``T`` anyway
   (``wait_d + local + h > T``): a request lost on either path goes where it stalls no
   stream.
   ``t = 1 - (u* + 1/2) / L``: ``d`` admits iff ``u <= u*`` (reasons ``local`` when
   ``u* >= L``, ``stall`` when the stall bound set it, else ``cost-model``). No
   compatible prefiller: :class:`Local`, ``no-prefiller``.

A P/D route (2. and 3.) names the prefiller ``remote`` assumed (the soonest by its
``min`` term; none where every one is as soon or that one also serves streams:
:meth:`GoodputModel.remote_path`), so the leg goes where the estimate priced it
rather than to the prefill ranking's first pick.

**routed spill**: with a spilling pool the policy ranks the spilling prefillers beside
the decoders (:attr:`GoodputPolicy.ranks_spill`). At such a pick it decides as for a
decoder (its queue's cached share the larger of its hit rate and the prompt's own);
when it would keep the prompt (and, queued, still answers within ``T``) it serves it
whole (:class:`Whole` on the pick, ``spill``), else :class:`Decline` (``declined``): the
planner ranks the decoders alone and asks again. Measurements behind each rule:
benchmarks/README.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from pd_orchestrator.model.load import Candidate
from pd_orchestrator.model.route import Ask, Decline, GoPD, Local, Route, Whole, at
from pd_orchestrator.policies.base import (
    POLICY,
    LatencyObservation,
    ThresholdContext,
    ThresholdPolicy,
    clamp_ratio,
)
from pd_orchestrator.policies.calibration import Probe, plan_probes
from pd_orchestrator.policies.goodput_model import (
    GoodputModel,
    GoodputParams,
    PoolModel,
    on_clock,
)
from pd_orchestrator.routing.interfaces import PluginContext
from pd_orchestrator.routing.registry import PluginType

__all__ = ["GOODPUT", "GoodputParams", "GoodputPolicy"]


@dataclass(slots=True)
class GoodputPolicy:
    """See the module docstring. Reasons: ``no-prefiller``, ``spill``, ``declined``,
    ``drain``, ``queued``, ``local``, ``cost-model``, ``stall``."""

    params: GoodputParams = field(default_factory=GoodputParams)
    name: str = "goodput"
    model: GoodputModel = field(init=False)
    parts: ClassVar[tuple[ThresholdPolicy, ...]] = ()
    ranks_spill: ClassVar[bool] = True
    observes: ClassVar[bool] = True
    bounds: ClassVar[tuple[float, float]] = (0.0, 1.0)

    def __post_init__(self) -> None:
        self.params = on_clock(self.params)
        self.model = GoodputModel(self.params)

    def decide(self, context: ThresholdContext) -> Route:
        return self._decide(context)[0]

    def chosen(self, context: ThresholdContext, route: Route) -> None:
        """Count in the duty cycle what ``route`` keeps at the context's decoder: what
        this policy's own route would keep when it is that route, else the prompt's
        uncached part when the route prefills there (:class:`Local`, :class:`Whole` on
        it, or :class:`Ask` at a threshold it meets); remember the hit rates the
        decision read from readings (worked out again, listing them)."""
        model = self.model
        seen: list[Candidate] = []
        model.reads = seen
        try:
            own, kept = self._decide(context)
        finally:
            model.reads = None
        if route != own:
            kept = self._kept(context, route)
        if kept is not None:
            model.keep(context.decoder.endpoint, context.now, kept)
        model.saw(seen)

    def _kept(self, context: ThresholdContext, route: Route) -> float | None:
        """The uncached tokens another policy's ``route`` keeps at the decoder (None:
        none)."""
        tokens = context.prompt_tokens
        if tokens <= 0:
            return None
        uncached = self.model.uncached(context)
        match route:
            case Local():
                return uncached
            case Whole(prefiller=name):
                return uncached if name == context.decoder.endpoint.name else None
            case Ask(threshold=threshold):
                return uncached if uncached <= (1.0 - threshold) * tokens else None
            case GoPD() | Decline():
                return None

    def observe(self, observation: LatencyObservation) -> None:
        self.model.observe(observation)

    def probes(self, candidates: Sequence[Candidate]) -> list[Probe]:
        """The cold prompts to time at start-up
        (:func:`~pd_orchestrator.policies.calibration.plan_probes`): on each pool of
        ``candidates`` with no profile that has learnt no local rate, each of
        ``probe_tokens`` (shortest first) ``probe_repeats`` times, within
        ``probe_seconds``, then on a pool that decodes the shortest as often again
        (three times at least) for ``probe_step_tokens`` output tokens (its decode
        step)."""
        p = self.params
        lengths = tuple(n for n in sorted(p.probe_tokens) for _ in range(p.probe_repeats))
        return plan_probes(
            candidates, self.model.unknown, lengths, p.probe_seconds, p.probe_step_tokens
        )

    def soonest(self, context: ThresholdContext, wait: float) -> str | None:
        """The peer (:attr:`ThresholdContext.peers`) where a drained request's decode
        leg starts soonest: the least prefill queued there, ties to fewer requests in
        flight, then to the ranking's order; None when none beats the chosen decoder's
        ``wait``. A crowded peer (its step with one more stream past ``tpot *
        tpot_goal``) takes none: a decode leg adds a stream there and no prefill, so the
        one with the least queued would take every drained leg."""
        m, p, tokens = self.model, self.params, context.prompt_tokens
        best: str | None = None
        key = (wait, context.decoder.in_flight)
        for peer in context.peers:
            pool = m.pool(peer.endpoint)
            if m.stream_step(pool, tokens, peer.streams + 1) > p.tpot * p.tpot_goal:
                continue
            queued = m.queued(peer, tokens, pool, m.hit_rate(peer) or 0.0)
            if (queued, peer.in_flight) < key:
                best, key = peer.endpoint.name, (queued, peer.in_flight)
        return best

    def spill_target(
        self,
        context: ThresholdContext,
        model: PoolModel,
        wait: float,
        *,
        queued: bool,
        target: float,
    ) -> str | None:
        """The prefiller that serves the request whole (module docstring, **spill**), or
        None: no healthy compatible prefiller spills, the decoder is neither crowded nor
        ``queued``, or none takes it sooner or with a shorter step within the target
        (``target``: the prompt's TTFT target ``T``)."""
        spills = [c for c in context.prefillers if c.endpoint.spill and c.healthy]
        if not spills:
            return None
        m, p, tokens = self.model, self.params, context.prompt_tokens
        step = m.stream_step(model, tokens, context.decoder.streams + 1)
        if not queued and step <= p.tpot * p.tpot_goal:
            return None
        best: tuple[tuple[float, float], str] | None = None
        for candidate in spills:
            pool = m.pool(candidate.endpoint)
            ttft = m.whole_seconds(context, candidate, pool)
            if ttft + p.hop > target:
                continue
            own = m.stream_step(pool, tokens, candidate.streams + 1)
            if own < step or (queued and ttft < wait):
                key = (ttft, own)
                if best is None or key < best[0]:
                    best = (key, candidate.endpoint.name)
        return None if best is None else best[1]

    def _decide(self, context: ThresholdContext) -> tuple[Route, float | None]:
        """The route, and the uncached tokens the decoder keeps if it keeps the prompt
        (None: it does not)."""
        if context.prompt_tokens <= 0:
            return Local(self.name, "local"), None
        route, kept = self._for_decoder(context)
        picked = context.decoder.endpoint
        if picked.spill:  # the routing's pick is a spilling prefiller (**routed spill**)
            if kept is None:
                return Decline(self.name, "declined"), None
            return Whole(self.name, "spill", picked.name), kept
        return route, kept

    def _for_decoder(self, context: ThresholdContext) -> tuple[Route, float | None]:
        """The route for ``context``'s decoder and what it keeps (module docstring)."""
        m, p, tokens = self.model, self.params, context.prompt_tokens
        model = m.pool(context.decoder.endpoint)
        path = m.remote_path(context, model)
        if path is None:
            if not context.decoder.endpoint.spill:
                return Local(self.name, "no-prefiller"), None
            path = (math.inf, None)  # a spilling pick with no other prefiller: no remote path
        remote, via = path
        hit = m.hit_rate(context.decoder)
        cached = context.cached_tokens
        uncached = m.uncached(context)
        wait = m.queued(context.decoder, tokens, model, m.queue_share(context))
        target = m.ttft_target(context, model)
        room = target * p.slack - wait - p.hop
        spill = self.spill_target(context, model, wait, queued=room <= 0.0, target=target)
        if spill is not None:
            return Whole(self.name, "spill", spill), None
        dedicated = any(not c.endpoint.role.decodes for c in context.prefillers)
        local = wait + model.local_seconds(uncached, tokens)  # the prompt kept here
        late = local + p.hop > target  # kept here, it misses its target anyway
        if room <= 0.0:
            known = hit is not None or cached is not None
            if dedicated and self._drains(local, remote, target, known=known):
                return GoPD(self.name, "drain", self.soonest(context, wait), prefiller=via), None
            keeps_none = context.decoder.endpoint.spill and late
            return Local(self.name, "queued"), None if keeps_none else uncached
        by_ttft = self._ttft_limit(model, tokens, wait, remote, target, dedicated=dedicated)
        # a real alternative to a stall: a prefiller that does not decode, in time, or
        # a prompt lost here anyway (nothing to save by a stall)
        sure = dedicated and (late or wait + remote <= self._in_time(context, target))
        by_stall = m.stall_limit(context, model) if sure else math.inf
        keep = min(by_ttft, by_stall)
        kept = uncached if uncached <= keep else None
        if keep >= tokens:
            return Local(self.name, "local"), kept
        reason = "stall" if by_stall < by_ttft else "cost-model"
        return at(clamp_ratio(1.0 - (keep + 0.5) / tokens), self.name, reason, via), kept

    def _ttft_limit(
        self, model: PoolModel, tokens: int, wait: float, remote: float, target: float, *,
        dedicated: bool,
    ) -> float:  # fmt: skip
        """The most uncached tokens the decoder keeps for the TTFT target ``target``
        (module docstring, 3.)."""
        p = self.params
        if dedicated:
            seconds = max(remote - p.hop, target * p.slack - wait - p.hop)
            return model.tokens_within(seconds, tokens)
        if wait + remote > target:
            return math.inf
        return model.tokens_within(target - wait - p.hop, tokens)

    def _in_time(self, context: ThresholdContext, target: float) -> float:
        """The time within which the remote path is a sure alternative to a stall: the
        TTFT target ``target``; ``target * slack`` beside a spilling prefiller, whose
        prefills stall the streams it serves whole."""
        if any(c.endpoint.spill for c in context.prefillers):
            return target * self.params.slack
        return target

    def _drains(self, local: float, remote: float, target: float, *, known: bool) -> bool:
        """Whether a queued decoder with a dedicated prefiller drains (module docstring,
        2.; ``target``: the prompt's TTFT target; ``known`` False: the wait is an upper
        bound)."""
        p = self.params
        if not known:
            return remote <= min(local, target * p.slack)
        return remote <= target and (remote <= local or local > target)


def _goodput(params: GoodputParams, context: PluginContext) -> GoodputPolicy:
    return GoodputPolicy(params, context.name)


GOODPUT = PluginType("goodput", POLICY, GoodputParams, _goodput)
