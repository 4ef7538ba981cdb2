"""The planner: the whole routing decision for one request (pure; no I/O).

Given what the request is (:class:`RequestFacts`: model, prompt size, affinity key,
prefix fields, the client's own threshold), a snapshot of the fleet (candidates
with health, in-flight counts and load) and the request's ordinal, the planner
returns a :class:`Plan`:

1. **Decoders**, ranked by the decode profile (filters, weighted scorers, picker):
   the first is asked first; the rest are where a failed attempt, an ask-all
   fan-out or a continuation goes, in that order.
   Each profile sees the endpoints of its role only, with one exception: for a
   threshold policy that ranks spilling prefillers (``ranks_spill``; decode-first, a
   request that names no prefillers), the decode profile also ranks the prefillers
   whose pool spills. When it picks one, the policy decides for it as for a decoder:
   :class:`Whole` or :class:`Local` serves the request whole there (the ranked
   decoders after it, for a failed attempt); any other route sends the planner back
   to rank the decoders alone.
2. **Fan-out**: the decoders the attempt asks (``asked``): all of them in turn for
   decode-first (one at a time; the next only if one cannot be reached), the top
   ``width`` at once for ask-all, or with ``width: adaptive`` the decoders likely to
   admit (:mod:`~pd_orchestrator.planner.width`; none: straight to P/D).
3. **Prefillers per decoder**: the prefill profile's ranking for each class of
   decoder in the plan (compatibility group and connector: the compatibility
   filter looks at nothing else of the decoder), over the plan's snapshot, or the
   prefillers the request named itself (a sidecar's header). A class's ranking is
   worked out when first asked for (:class:`PrefillRanking`): a request its
   decoder admits needs none, unless the threshold policy reads the prefillers.
4. **Route**: the policy's :data:`~pd_orchestrator.model.route.Route` for the first
   decoder, which sees that decoder's load and the prompt's size and, read lazily
   (:class:`_Reads`: worked out the first time the policy asks), its compatible
   prefillers' load, for decode-first its *peers* (the other ranked decoders those
   prefillers reach) and, when the planner has a :class:`CachedPrefix` (the gateway's
   precise prefix index), the prompt tokens an endpoint holds. :class:`GoPD` may name
   a peer to decode on: it then leads the plan's decoders. :class:`Whole` names a
   prefiller whose pool spills: it then leads the plan's decoders, and serves the
   request itself. The policy is then told the final route
   (:meth:`~pd_orchestrator.policies.threshold.ThresholdResolver.chosen`), and for a
   spilling pick it declined, :class:`Decline`.
5. **Prompt size** in tokens (exact when counted, else estimated from its
   characters), which lengthens the read timeouts of the request's legs.
6. **Spare decoders** (:meth:`Plan.spare_decoders`): the decode profile's ranking
   with health set aside, worked out only for a request that has no decoder of its
   plan left (a recovery may still try one that is out of routing only because a
   leg broke on it).

Routing state is per request: every profile run of one request carries the same
ordinal (``RoutingRequest.sequence``), which the gateway advances once per request,
so a rotating picker rotates once per request and ties spread requests evenly.
What the planner learns comes back after the request: :meth:`Planner.learn`.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal, Protocol, assert_never

from pd_orchestrator.config.settings import AskAllFallbackConfig
from pd_orchestrator.model.endpoints import Endpoint, Role
from pd_orchestrator.model.load import Candidate
from pd_orchestrator.model.records import record
from pd_orchestrator.model.route import Ask, Decline, GoPD, Local, Route, Whole, threshold_of
from pd_orchestrator.planner.choices import FleetView, next_decoder, pick_fallback, suspects
from pd_orchestrator.planner.width import AdaptiveWidth, Asked
from pd_orchestrator.policies.base import LatencyObservation, ThresholdContext
from pd_orchestrator.policies.estimator import PromptLengthEstimator
from pd_orchestrator.policies.threshold import ThresholdResolver
from pd_orchestrator.routing.engine import Profile
from pd_orchestrator.routing.profiles import RoutingProfiles
from pd_orchestrator.routing.types import PrefixFields, RoutingRequest, RoutingResult

__all__ = [
    "DECODE_ONLY",
    "NOT_CONTINUABLE",
    "CachedPrefix",
    "NoCandidateError",
    "Plan",
    "Planner",
    "PrefillRanking",
    "RequestFacts",
    "Served",
    "after_prefill",
    "alone_at",
    "compatibility_class",
    "leg_seconds",
    "queued_at",
]

DECODE_ONLY = Local("none", "no-threshold")
"""The decision of a planner without a threshold resolver (every decoder admits)."""

NO_PREFILLER = Local("gateway", "no-prefiller")
"""The decision for a request no prefiller can serve: the fleet has none, or the
request named none (a sidecar without llm-d's prefiller header: llm-d then serves on
the decoder alone). Admitted wherever it goes, whatever its own threshold."""

NOT_CONTINUABLE = Local("gateway", "not-continuable")
"""The decision for a request a continuation could not honour (see
:attr:`RequestFacts.continuable`) when a decoder it may go to cannot take it
admission-only (an older plugin): admitted wherever it goes, never handed back."""

Width = Literal["all", "adaptive"] | int
_PRIOR = PromptLengthEstimator(calibrate=False)
"""Prompt sizes of a planner without a threshold resolver (the estimator's prior)."""


class NoCandidateError(LookupError):
    """The filters left no endpoint; the message says which filter dropped what."""


@record
class RequestFacts:
    """What the planner knows of a request.

    ``prompt_chars`` sizes the prompt when ``prompt_tokens`` (an exact count) is not
    known; ``affinity_key`` keeps a conversation's turns together among equals;
    ``fields`` are the prefix scorers' inputs; ``client_threshold`` is the request's
    own ``cache_hit_threshold``; ``prefillers`` are the prefillers the request names
    itself (None: the prefill profile ranks them; empty: it names none, and is served
    by its decoder alone). ``continuable``: a continuation
    would honour the request (no tools, structured outputs or logprobs); one that is
    not gets the policy's threshold admission-only (a cold one goes P/D, a decoder
    never hands it back) when every decoder it may be asked on says it honours that
    (:attr:`~pd_orchestrator.model.load.Candidate.admission_only`, from its latest
    reading even when stale), else threshold 0. ``resumable``: a continuation honours
    the request where the plugin advances its structured output's grammar
    (``cache_hit_resume_tokens``): it is continuable when every decoder it may be asked
    on and every prefiller that can reach its decoder says so
    (:attr:`~pd_orchestrator.model.load.Candidate.resumes`), else handled as one that
    is not.
    """

    model: str
    prompt_chars: int
    affinity_key: str | None = None
    fields: PrefixFields = field(default_factory=PrefixFields)
    client_threshold: float | None = None
    prompt_tokens: int | None = None
    prefillers: tuple[Endpoint, ...] | None = None
    continuable: bool = True
    resumable: bool = False


def compatibility_class(decoder: Endpoint) -> tuple[str, str]:
    """What of a decoder decides which prefillers can reach it."""
    return (decoder.group, decoder.connector)


class PrefillRanking:
    """The prefill profile's ranking for each class of decoder, over the plan's
    snapshot (or the prefillers a request named itself), worked out the first time
    a class is asked for: most requests are admitted and never need one."""

    __slots__ = ("_cache", "_candidates", "_connector_pairs", "_named", "_pairs", "_profile",
                 "_routing")  # fmt: skip

    def __init__(
        self,
        profile: Profile,
        routing: RoutingRequest,
        candidates: tuple[Candidate, ...],
        pairs: frozenset[tuple[str, str]],
        connector_pairs: frozenset[tuple[str, str]],
        named: tuple[Endpoint, ...] | None,
    ) -> None:
        self._profile = profile
        self._routing = routing
        self._candidates = candidates
        self._pairs = pairs
        self._connector_pairs = connector_pairs
        self._named = named
        self._cache: dict[tuple[str, str, str], tuple[Endpoint, ...]] = {}

    def for_decoder(self, decoder: Endpoint) -> tuple[Endpoint, ...]:
        """Prefillers whose KV can reach ``decoder``, best first (may be empty); never
        ``decoder`` itself (an endpoint that also prefills does not prefill for itself,
        so its ranking is its own, not its class's)."""
        key = (*compatibility_class(decoder), decoder.name if decoder.role.prefills else "")
        ranked = self._cache.get(key)
        if ranked is None:
            if self._named is not None:
                ranked = tuple(e for e in self._named if e.name != decoder.name)
            else:
                request = _for_prefill(self._routing, decoder, self._pairs, self._connector_pairs)
                ranked = self._profile.run(request, self._candidates).endpoints
            self._cache[key] = ranked
        return ranked


@record
class _Asking:
    """One request as the planner asks its policy about it: its facts and routing
    request, the snapshot's decoders and prefillers, the prefill ranking, its tokens."""

    facts: RequestFacts
    routing: RoutingRequest
    decoders: tuple[Candidate, ...]
    prefillers: PrefillRanking
    prefillers_in: tuple[Candidate, ...]
    tokens: int


@record
class _Choice:
    """A ranking's pick, whether a continuation honours the request there, the route
    for it and the context the policy decided on (None: the planner decided alone)."""

    decoder: Candidate
    continuable: bool
    route: Route
    context: ThresholdContext | None = None


class _Reads:
    """What a policy reads of the plan beyond the pick
    (:class:`~pd_orchestrator.policies.base.ContextReads`), worked out the first time
    it asks: the pick's compatible prefillers (in snapshot order), its peers (for
    decode-first), the prompt tokens an endpoint holds by the planner's cache."""

    __slots__ = ("_asking", "_cache", "_cached", "_decode_first", "_decoder", "_peers",
                 "_prefillers", "_ranking")  # fmt: skip

    def __init__(
        self,
        asking: _Asking,
        decoder: Candidate,
        ranking: RoutingResult,
        cache: CachedPrefix | None,
        *,
        decode_first: bool,
    ) -> None:
        self._asking, self._decoder, self._ranking = asking, decoder, ranking
        self._cache, self._decode_first = cache, decode_first
        self._prefillers: tuple[Candidate, ...] | None = None
        self._peers: tuple[Candidate, ...] | None = None
        self._cached: dict[str, int | None] = {}

    def prefillers(self) -> tuple[Candidate, ...]:
        if self._prefillers is None:
            asking = self._asking
            reach = {e.name for e in asking.prefillers.for_decoder(self._decoder.endpoint)}
            self._prefillers = tuple(c for c in asking.prefillers_in if c.endpoint.name in reach)
        return self._prefillers

    def peers(self) -> tuple[Candidate, ...]:
        if self._peers is None:
            self._peers = _peers(self._ranking) if self._decode_first else ()
        return self._peers

    def cached_tokens(self, endpoint: Endpoint) -> int | None:
        if self._cache is None:
            return None
        name = endpoint.name
        if name not in self._cached:
            cached = self._cache.cached_tokens(self._asking.routing, endpoint)
            self._cached[name] = None if cached is None else max(0, cached)
        return self._cached[name]


@record
class Plan:
    """The routing decision for one request (see the module docstring)."""

    decoders: tuple[Endpoint, ...]
    asked: tuple[Endpoint, ...]
    route: Route
    prefillers: PrefillRanking
    candidates: tuple[Candidate, ...]
    routing: RoutingRequest
    ranking: RoutingResult
    prompt_tokens: int = 0
    decode_profile: Profile | None = None
    width: Asked | None = None
    """The adaptive width's choice (None: a fixed width): why ``asked`` is what it is,
    and the prompt's block keys, which the planner learns from after the request."""
    continuable: bool = True
    """A continuation honours the request on this plan (a hand-back or a recovery may
    resubmit it): :attr:`RequestFacts.continuable`, or resumable where the plan's
    endpoints resume its grammar."""
    blocks: Sequence[int] = ()
    """The block keys of the prompt, by the planner's :class:`CachedPrefix` (empty
    without one): the legs hold them pending on the endpoint that prefills the prompt
    until its first answer (:meth:`CachedPrefix.blocks`), for the cache's counts that a
    policy reads."""

    @property
    def decoder(self) -> Endpoint:
        return self.decoders[0]

    def spare_decoders(self) -> tuple[Endpoint, ...]:
        """Every decoder the decode profile ranks with health set aside, best first
        (worked out on each call: only a request with no decoder of its plan left asks)."""
        profile = self.decode_profile
        if profile is None:
            return ()
        everyone = [replace(c, healthy=True) for c in self.candidates if c.endpoint.role.decodes]
        return profile.run(self.routing, everyone).endpoints

    @property
    def ordinal(self) -> int:
        return self.routing.sequence

    def prefillers_for(self, decoder: Endpoint) -> tuple[Endpoint, ...]:
        """Prefillers whose KV can reach ``decoder``, best first (may be empty): the
        route's ``prefiller`` first when it names one of them, then the ranking's order."""
        ranked = self.prefillers.for_decoder(decoder)
        named = self.route.prefiller if isinstance(self.route, Ask | GoPD) else None
        if named is None or not ranked or ranked[0].name == named:
            return ranked
        first = tuple(e for e in ranked if e.name == named)
        return (*first, *(e for e in ranked if e.name != named)) if first else ranked

    def next_decoder(self, failed: Collection[str], fleet: FleetView) -> Endpoint | None:
        """Where the request goes after the endpoints in ``failed`` failed it
        (:func:`~pd_orchestrator.planner.choices.next_decoder`; the spares are worked
        out only when the plan's decoders are spent)."""
        found = next_decoder(self.decoders, (), failed, fleet)
        if found is None:
            found = next_decoder((), self.spare_decoders(), failed, fleet)
        return found

    def retried(self, failed: Collection[str], fleet: FleetView) -> Plan | None:
        """The plan to start over on after the endpoints in ``failed`` failed it before
        the first byte: its decoders and asked decoders without them (the suspects
        among the spares when none is left); None when no decoder is left."""
        decoders = tuple(d for d in self.decoders if d.name not in failed)
        if not decoders:
            decoders = suspects(self.spare_decoders(), failed, fleet)
        if not decoders:
            return None
        asked = tuple(d for d in self.asked if d.name not in failed)
        if self.asked and not asked:
            asked = decoders[:1]
        return replace(self, decoders=decoders, asked=asked)

    def following(self, decoder: Endpoint) -> Plan:
        """The plan of a request's other choices once its choice 0 is served by
        ``decoder``, which now holds the prompt: ``decoder`` asked alone, then the
        plan's other decoders (for a retry)."""
        rest = tuple(d for d in self.decoders if d.name != decoder.name)
        return replace(self, decoders=(decoder, *rest), asked=(decoder,), width=None)

    def fallback(self, config: AskAllFallbackConfig) -> Endpoint:
        """The decoder that takes the request when every asked decoder rejected it: the
        best of the asked decoders, or of every decoder when the width is adaptive (it
        asked only likely holders, or none)."""
        width = self.width
        if width is None:
            return pick_fallback(self.asked, self.candidates, config, self.ordinal)
        return pick_fallback(self.decoders, self.candidates, config, self.ordinal, width.partial)


@record
class Served:
    """What a served request teaches the planner: where it went and how it went.

    ``decoder``: the decoder that served it (None: no decoder served it); ``ttft`` and
    ``itl`` in seconds; ``prompt_tokens``: what upstream counted for the prompt;
    ``cached_tokens``: of those, what the serving decoder had cached (None: unknown);
    ``output_tokens``: tokens generated; ``remote``: prefilled on a prefiller (None:
    unknown); ``rejected``: the decoders that rejected it at its threshold;
    ``after_prefill``: of a P/D request, seconds from the prefill leg's answer to the
    first content (:func:`after_prefill`; None: unknown); ``prefiller``: of a P/D
    request, the prefiller that prefilled it (None: none, or unknown);
    ``prefill_cached``: of a P/D request, the prompt tokens its prefiller had cached
    (None: not reported); ``prefill_seconds``: of a P/D request, seconds from its
    prefill leg's send to the answer (:func:`leg_seconds`; None: unknown).
    """

    decoder: Endpoint | None
    now: float
    ttft: float | None = None
    itl: float | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    output_tokens: int = 0
    remote: bool | None = None
    rejected: tuple[str, ...] = ()
    after_prefill: float | None = None
    prefiller: Endpoint | None = None
    prefill_cached: int | None = None
    prefill_seconds: float | None = None


def queued_at(prefilled: Candidate | None) -> bool | None:
    """Whether the endpoint that prefilled a served prompt (its prefiller when it went
    P/D, else its decoder), as the plan's snapshot saw it, had prompts queued when the
    plan was made: tokens the gateways counted queued there, or requests its reading
    showed waiting (None: that endpoint is not in the snapshot, or unknown)."""
    if prefilled is None:
        return None
    load = prefilled.load
    return prefilled.backlog > 0 or (load is not None and load.waiting > 0)


def alone_at(prefilled: Candidate | None, queued: bool | None) -> bool | None:
    """Whether the endpoint that prefilled a served prompt, as the plan's snapshot saw
    it, had nothing else there when the plan was made: no request running by the
    gateways' counts, none of anyone else's by its fresh reading
    (:attr:`Candidate.others`: a reading taken while a request of the gateways' ran,
    one since answered, does not count that one), nothing ``queued``
    (:func:`queued_at`'s; None: not in the snapshot, or no fresh reading, so another
    gateway's requests may have been there)."""
    if prefilled is None or prefilled.load is None:
        return None
    return prefilled.in_flight == 0 and prefilled.others == 0 and not queued


def _planned(plan: Plan, endpoint: Endpoint | None) -> Candidate | None:
    """``endpoint`` as ``plan``'s snapshot saw it (None: not in it, or no endpoint)."""
    if endpoint is None:
        return None
    for candidate in plan.candidates:
        if candidate.endpoint.name == endpoint.name:
            return candidate
    return None


def leg_seconds(sent: float | None, answered: float | None) -> float | None:
    """Seconds from a leg's send at ``sent`` to its answer at ``answered`` (None: either
    unknown, or the answer before the send, on no clock a leg runs on)."""
    if sent is None or answered is None or answered < sent:
        return None
    return answered - sent


def after_prefill(arrival: float, ttft: float | None, answered: float | None) -> float | None:
    """Seconds from a prefill answer at ``answered`` to the first content of a request
    that arrived at ``arrival`` (``ttft`` after it); None when either is unknown or the
    answer came after the first content (a continuation's prefill)."""
    if ttft is None or answered is None or arrival + ttft < answered:
        return None
    return arrival + ttft - answered


class CachedPrefix(Protocol):
    """Where the planner learns how much of a prompt a decoder holds in its prefix
    cache (:attr:`~pd_orchestrator.policies.base.ThresholdContext.cached_tokens`)."""

    def cached_tokens(self, request: RoutingRequest, decoder: Endpoint) -> int | None:
        """Leading prompt tokens of ``request`` that ``decoder`` holds, or will hold
        when it reaches the prompt: with those of its prompts in flight (None:
        unknown)."""
        ...

    def blocks(self, request: RoutingRequest) -> Sequence[int]:
        """The block keys of ``request``'s prompt that a leg holds pending on its
        endpoint until its first answer, for :meth:`cached_tokens` to count (empty:
        none; the sequence is shared, not to be changed)."""
        ...


@dataclass(frozen=True)
class Planner:
    """The routing profiles, the threshold resolver (None: threshold 0, as in a
    decode-only fleet), the host-staged group pairs, the ask-all width (None:
    decode-first, the decoders are asked one at a time), the bridged
    ``(prefill connector, decode connector)`` pairs and, for ``width: adaptive``,
    the :class:`~pd_orchestrator.planner.width.AdaptiveWidth` that chooses whom to ask,
    and ``cache``, what the endpoints' prefix caches hold (read when a policy asks; the
    legs hold each prompt's blocks pending on it)."""

    profiles: RoutingProfiles
    threshold: ThresholdResolver | None = None
    allowed_pairs: frozenset[tuple[str, str]] = frozenset()
    width: Width | None = None
    connector_pairs: frozenset[tuple[str, str]] = frozenset()
    adaptive: AdaptiveWidth | None = None
    cache: CachedPrefix | None = None

    def plan(
        self,
        facts: RequestFacts,
        candidates: Sequence[Candidate],
        now: float,
        ordinal: int,
    ) -> Plan:
        """The plan for one request; :class:`NoCandidateError` when no decoder passes."""
        candidates = tuple(candidates)
        decoders_in = tuple([c for c in candidates if c.endpoint.role.decodes])
        prefillers_in = tuple([c for c in candidates if c.endpoint.role.prefills])
        fields = facts.fields
        routing = RoutingRequest(
            role=Role.DECODE,
            now=now,
            model=facts.model,
            prompt=fields.prompt,
            affinity_key=facts.affinity_key,
            token_ids=fields.token_ids,
            lora=fields.lora,
            cache_salt=fields.cache_salt,
            sequence=ordinal,
        )
        prefillers = PrefillRanking(
            self.profiles.prefill,
            routing,
            prefillers_in,
            self.allowed_pairs,
            self.connector_pairs,
            facts.prefillers,
        )
        asking = _Asking(facts, routing, decoders_in, prefillers, prefillers_in,
                         self._prompt_tokens(facts))  # fmt: skip
        ranking = self._ranking(facts, routing, decoders_in, prefillers_in)
        choice = self._choose(asking, ranking)
        if choice.decoder.endpoint.spill and not _served_whole(choice.route):
            # the spilling prefiller the routing picked does not take it: decoders only
            declined, route = choice, choice.route
            ranking = self.profiles.decode.run(routing, decoders_in)
            choice = self._choose(asking, ranking)
            self._tell(declined, Decline(route.policy, route.reason))
        route = _final(choice.route)
        if self._tell(choice, route) and not choice.continuable:
            route = replace(route, admission_only=True)  # every decoder asked takes it
        decoders = _leading(_decoding(ranking, choice.decoder), route, prefillers_in)
        width = self._adaptive(routing, decoders, candidates, threshold_of(route))
        return Plan(
            decoders=decoders,
            asked=self._asked(decoders) if width is None else width.decoders,
            route=route,
            prefillers=prefillers,
            candidates=candidates,
            routing=routing,
            ranking=ranking,
            prompt_tokens=asking.tokens,
            decode_profile=self.profiles.decode,
            width=width,
            continuable=choice.continuable,
            blocks=() if self.cache is None else self.cache.blocks(routing),
        )

    def _ranking(
        self,
        facts: RequestFacts,
        routing: RoutingRequest,
        decoders: tuple[Candidate, ...],
        prefillers: tuple[Candidate, ...],
    ) -> RoutingResult:
        """The decode profile's ranking of the ``decoders``, with the spilling
        ``prefillers`` ranked beside them (:meth:`_spills`)."""
        spills = self._spills(facts, prefillers)
        if not spills:
            return self.profiles.decode.run(routing, decoders)
        # the role filter keeps every candidate for a request of role ``both``
        return self.profiles.decode.run(replace(routing, role=Role.BOTH), (*decoders, *spills))

    def _tell(self, choice: _Choice, route: Route) -> bool:
        """Tell the policy that decided ``choice`` the route its pick took (a declined
        spilling pick: :class:`Decline`); False when no policy decided it."""
        if choice.context is None or self.threshold is None:
            return False
        self.threshold.chosen(choice.context, route)
        return True

    def _spills(
        self, facts: RequestFacts, prefillers: tuple[Candidate, ...]
    ) -> tuple[Candidate, ...]:
        """The prefillers whose pool spills, ranked with the decoders: only for a policy
        that ranks them (``ranks_spill``), for decode-first, and for a request that
        names no prefillers of its own."""
        resolver = self.threshold
        if resolver is None or not resolver.ranks_spill:
            return ()
        if self.width is not None or facts.prefillers is not None:
            return ()
        return tuple(c for c in prefillers if c.endpoint.spill)

    def _choose(self, asking: _Asking, ranking: RoutingResult) -> _Choice:
        """The ranking's pick, whether a continuation honours the request there, and the
        route for it; :class:`NoCandidateError` when the ranking is empty."""
        if ranking.pick is None:
            raise NoCandidateError(_why("decoder", ranking))
        decoder, facts = ranking.pick.candidate, asking.facts
        continuable = facts.continuable or (
            facts.resumable and self._resumes(decoder, asking.decoders, asking.prefillers,
                                              asking.prefillers_in)
        )  # fmt: skip
        resolver = self.threshold
        if resolver is None:
            return _Choice(decoder, continuable, DECODE_ONLY)
        if not continuable and not self._admission_only(decoder, asking.decoders):
            return _Choice(decoder, continuable, NOT_CONTINUABLE)
        if facts.prefillers == () or (facts.prefillers is None and not asking.prefillers_in):
            return _Choice(decoder, continuable, NO_PREFILLER)
        reads = _Reads(asking, decoder, ranking, self.cache, decode_first=self.width is None)
        context = ThresholdContext(
            facts.model, decoder, asking.tokens, facts.prompt_chars, facts.client_threshold,
            asking.routing.now, reads,
        )  # fmt: skip
        return _Choice(decoder, continuable, resolver.decide(context), context)

    def _prompt_tokens(self, facts: RequestFacts) -> int:
        """The prompt's tokens: counted, or estimated from its characters."""
        if facts.prompt_tokens is not None:
            return facts.prompt_tokens
        if self.threshold is not None:
            return self.threshold.estimate_tokens(facts.model, facts.prompt_chars)
        return _PRIOR.estimate(facts.model, facts.prompt_chars)

    def _asked(self, decoders: tuple[Endpoint, ...]) -> tuple[Endpoint, ...]:
        width = self.width
        if width is None or width == "all" or width == "adaptive":
            return decoders
        return decoders[:width]

    def _adaptive(
        self,
        routing: RoutingRequest,
        decoders: tuple[Endpoint, ...],
        candidates: tuple[Candidate, ...],
        threshold: float,
    ) -> Asked | None:
        """The adaptive width's choice (None: the width is fixed)."""
        if self.width != "adaptive" or self.adaptive is None:
            return None
        return self.adaptive.asked(routing, decoders, candidates, threshold)

    def _asked_on(self, decoder: Candidate, decoders: tuple[Candidate, ...]) -> Iterator[Candidate]:
        """The healthy decoders a request may be asked on: decode-first's pick; ask-all's
        every healthy decoder."""
        asked = (decoder,) if self.width is None else (decoder, *decoders)
        return (c for c in asked if c.healthy)

    def _admission_only(self, decoder: Candidate, decoders: tuple[Candidate, ...]) -> bool:
        """Whether every decoder the request may be asked on takes a threshold at
        admission only."""
        return all(c.admission_only for c in self._asked_on(decoder, decoders))

    def _resumes(
        self,
        decoder: Candidate,
        decoders: tuple[Candidate, ...],
        ranking: PrefillRanking,
        prefillers: tuple[Candidate, ...],
    ) -> bool:
        """Whether every decoder the request may be asked on, and every healthy
        prefiller that can reach the pick, advances a grammar over resumed tokens (a
        continuation's prefill leg carries the constraint too)."""
        if not all(c.resumes for c in self._asked_on(decoder, decoders)):
            return False
        reach = {e.name for e in ranking.for_decoder(decoder.endpoint)}
        return all(c.resumes for c in prefillers if c.healthy and c.endpoint.name in reach)

    def learn(self, plan: Plan, facts: RequestFacts, served: Served) -> None:
        """Feed a finished request back: the decode profile's learning plugins see
        where it was served; the adaptive width what the decoders hold; the threshold
        policies its latencies and prompt size."""
        self._learn_width(plan, served)
        decoder = served.decoder
        if decoder is None:
            return
        self.profiles.decode.observe(plan.routing, decoder)
        resolver = self.threshold
        if resolver is None:
            return
        if resolver.observes:
            _observe(resolver, plan, facts, served, decoder)
        if served.prompt_tokens and facts.prompt_tokens is None:
            resolver.observe_usage(facts.model, facts.prompt_chars, served.prompt_tokens)

    def _learn_width(self, plan: Plan, served: Served) -> None:
        """The decoders that rejected the prompt lack part of it; the one that served it
        holds it all (rejections first: the rejecting decoder may be the one that
        then served it through P/D)."""
        adaptive, width = self.adaptive, plan.width
        if adaptive is None or width is None:
            return
        for name in served.rejected:
            adaptive.rejected(width.keys, name, threshold_of(plan.route), width.blocks)
        if served.decoder is not None:
            adaptive.served(width.keys, served.decoder.name)


def _observe(
    resolver: ThresholdResolver, plan: Plan, facts: RequestFacts, served: Served, decoder: Endpoint
) -> None:
    """Tell the threshold policies one finished request's latencies, with the load its
    decoder (and prefiller) had when it was planned."""
    planned = _planned(plan, decoder)
    prefilled = _planned(plan, served.prefiller) if served.remote else planned
    queued = queued_at(prefilled)
    resolver.observe(
        LatencyObservation(
            facts.model,
            decoder.pool,
            served.now,
            served.ttft,
            served.itl,
            prompt_tokens=served.prompt_tokens,
            cached_tokens=served.cached_tokens,
            output_tokens=served.output_tokens,
            remote=served.remote,
            after_prefill=served.after_prefill,
            queued=queued,
            alone=alone_at(prefilled, queued),
            prefill_cached=served.prefill_cached,
            prefill_seconds=served.prefill_seconds,
            streams=None if planned is None else planned.streams,
        )
    )


def _peers(ranking: RoutingResult) -> tuple[Candidate, ...]:
    """The ranked decoders after the pick that the same prefillers reach (the pick's
    compatibility class), in ranking order, with their load."""
    pick, *rest = ranking.ranked
    kind = compatibility_class(pick.endpoint)
    return tuple(
        s.candidate
        for s in rest
        if s.endpoint.role.decodes and compatibility_class(s.endpoint) == kind
    )


def _decoding(ranking: RoutingResult, pick: Candidate) -> tuple[Endpoint, ...]:
    """The ranked endpoints that decode, best first, led by ``pick`` when it is a spilling
    prefiller (ranked beside them, it serves the request whole)."""
    decoders = tuple([e for e in ranking.endpoints if e.role.decodes])
    return (pick.endpoint, *decoders) if pick.endpoint.spill else decoders


def _served_whole(route: Route) -> bool:
    """Whether ``route``, answered for a spilling prefiller the routing picked, serves
    the request there (prefilled locally or named whole); any other declines it."""
    match route:
        case Local() | Whole():
            return True
        case Ask() | GoPD() | Decline():
            return False
        case _:
            assert_never(route)


def _final(route: Route) -> Ask | Local | GoPD | Whole:
    """``route`` for the plan: a :class:`Decline` answered for a decoder (only a
    spilling prefiller can be declined) goes P/D at once, as no decoder admits it."""
    match route:
        case Decline(policy=policy, reason=reason):
            return GoPD(policy, reason)
        case Ask() | Local() | GoPD() | Whole():
            return route
        case _:
            assert_never(route)


def _leading(
    decoders: tuple[Endpoint, ...], route: Route, prefillers: tuple[Candidate, ...]
) -> tuple[Endpoint, ...]:
    """``decoders`` led by the one the route names: a ranked decoder moves first; a
    prefiller whose pool spills (:attr:`~pd_orchestrator.model.endpoints.Endpoint.spill`),
    named by :class:`Whole`, goes first and serves the request whole, the ranked
    decoders after it for a failed attempt. Unchanged when it names none, or an
    endpoint that is neither."""
    match route:
        case GoPD(peer=str() as name):
            lead = next((e for e in decoders if e.name == name), None)
        case Whole(prefiller=name):
            lead = next((e for e in decoders if e.name == name), None)
            if lead is None:
                spills = (c.endpoint for c in prefillers if c.endpoint.spill)
                lead = next((e for e in spills if e.name == name), None)
        case _:
            lead = None
    if lead is None or lead is decoders[0]:
        return decoders
    return (lead, *(e for e in decoders if e is not lead))


def _for_prefill(
    routing: RoutingRequest,
    decoder: Endpoint,
    pairs: frozenset[tuple[str, str]],
    connector_pairs: frozenset[tuple[str, str]],
) -> RoutingRequest:
    """The decode routing request, asking for prefillers of ``decoder``."""
    return RoutingRequest(
        role=Role.PREFILL,
        now=routing.now,
        model=routing.model,
        prompt=routing.prompt,
        affinity_key=routing.affinity_key,
        token_ids=routing.token_ids,
        lora=routing.lora,
        cache_salt=routing.cache_salt,
        decoder=decoder,
        allowed_pairs=pairs,
        allowed_connector_pairs=connector_pairs,
        sequence=routing.sequence,
    )


def _why(what: str, result: RoutingResult) -> str:
    drops = result.describe_drops()
    return f"no {what} can take this request" + (f" ({drops})" if drops else "")
