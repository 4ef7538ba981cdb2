"""The threshold policy interface: what a policy sees, what it returns, what it learns.

A policy maps a :class:`ThresholdContext` (the request's model and size, the
chosen decoder with its load, the compatible prefillers with theirs, the client's
own threshold, the clock) to a :data:`~pd_orchestrator.model.route.Route`: ask the
decoder at a threshold, prefill locally, go P/D now, serve whole on a spilling
prefiller, or decline, with the policy that chose it and a short reason. The decoder
admits a request iff its prefix-cache hit ratio (cached tokens / prompt tokens) is at
least the threshold, so a higher threshold sends more requests through P/D and a
lower one keeps more prefill on the decoder.

Policies do no I/O and read no clock but ``context.now``. Some keep state (a
smoothed value, a window of latencies, what they kept where); :meth:`~ThresholdPolicy.decide`
changes none of it: they learn from :meth:`~ThresholdPolicy.chosen` (the final route
of a request they decided, after composition) and :meth:`~ThresholdPolicy.observe`
(its latencies). Their output is a deterministic function of that sequence of calls,
so a replay of one sequence decides alike.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import ClassVar, Protocol

from pd_orchestrator.model.endpoints import Endpoint
from pd_orchestrator.model.load import Candidate, LoadSnapshot
from pd_orchestrator.model.records import record
from pd_orchestrator.model.route import Route
from pd_orchestrator.routing.registry import PluginKind

__all__ = [
    "NOTHING",
    "POLICY",
    "ContextReads",
    "Given",
    "LatencyObservation",
    "Leaf",
    "ThresholdContext",
    "ThresholdPolicy",
    "clamp_ratio",
    "ramp",
]


def clamp_ratio(value: float, low: float = 0.0, high: float = 1.0) -> float:
    """``value`` limited to [low, high]; NaN becomes ``low``."""
    if math.isnan(value):
        return low
    return min(high, max(low, value))


def ramp(value: float, start: float, full: float) -> float:
    """0 at or below ``start``, 1 at or above ``full``, linear between (``full > start``)."""
    return clamp_ratio((value - start) / (full - start))


class ContextReads(Protocol):
    """Where a :class:`ThresholdContext`'s lazy parts come from: the planner's snapshot
    (worked out the first time a policy asks), or :class:`Given` values."""

    def prefillers(self) -> tuple[Candidate, ...]:
        """The prefillers whose KV can reach the decoder, with their readings."""
        ...

    def peers(self) -> tuple[Candidate, ...]:
        """The other ranked decoders the same prefillers reach, best first."""
        ...

    def cached_tokens(self, endpoint: Endpoint) -> int | None:
        """The prompt tokens ``endpoint`` holds by the prefix index (None: unknown)."""
        ...


class Given:
    """:class:`ContextReads` of fixed values: ``cached`` maps an endpoint's name to the
    prompt tokens it holds (absent: unknown)."""

    __slots__ = ("_cached", "_peers", "_prefillers")

    def __init__(
        self,
        prefillers: tuple[Candidate, ...] = (),
        peers: tuple[Candidate, ...] = (),
        cached: Mapping[str, int] | None = None,
    ) -> None:
        self._prefillers, self._peers = prefillers, peers
        self._cached = dict(cached or {})
        if any(tokens < 0 for tokens in self._cached.values()):
            raise ValueError("cached tokens must be >= 0")

    def prefillers(self) -> tuple[Candidate, ...]:
        return self._prefillers

    def peers(self) -> tuple[Candidate, ...]:
        return self._peers

    def cached_tokens(self, endpoint: Endpoint) -> int | None:
        return self._cached.get(endpoint.name)


NOTHING = Given()
"""Reads of a context that knows no prefiller, no peer and no cache."""


@record
class ThresholdContext:
    """What a policy may look at for one request.

    ``model``: the requested model. ``decoder``: the chosen decoder (its endpoint
    names the pool; ``in_flight`` counts the gateway's own requests on it; ``load``
    is its latest fresh reading, None when stale or never read). For a policy that
    ranks spilling prefillers (:attr:`ThresholdPolicy.ranks_spill`) it may be a
    prefiller whose pool spills, which the decode routing ranked beside the decoders:
    :class:`~pd_orchestrator.model.route.Whole` or
    :class:`~pd_orchestrator.model.route.Local` serves the request whole there, any
    other route declines it (the planner then asks about a decoder).
    ``prompt_tokens``: the prompt's length in tokens, exact or estimated from
    ``prompt_chars`` (:class:`~pd_orchestrator.policies.estimator.PromptLengthEstimator`).
    ``client_threshold``: the request's own ``cache_hit_threshold``, if any. ``now``:
    the caller's clock, the one load readings are stamped with.

    The rest is read through ``reads`` (:class:`ContextReads`), worked out the first
    time a policy asks for it: :attr:`prefillers`, :attr:`peers`,
    :attr:`cached_tokens` and :meth:`cached_on`.
    """

    model: str
    decoder: Candidate
    prompt_tokens: int
    prompt_chars: int = 0
    client_threshold: float | None = None
    now: float = 0.0
    reads: ContextReads = NOTHING

    def __post_init__(self) -> None:
        if self.prompt_tokens < 0 or self.prompt_chars < 0:
            raise ValueError("prompt_tokens and prompt_chars must be >= 0")
        if not math.isfinite(self.now):
            raise ValueError("now must be finite")

    @property
    def pool(self) -> str:
        """The chosen decoder's pool."""
        return self.decoder.endpoint.pool

    @property
    def decoder_load(self) -> LoadSnapshot | None:
        return self.decoder.load

    @property
    def decoder_in_flight(self) -> int:
        return self.decoder.in_flight

    @property
    def prefillers(self) -> tuple[Candidate, ...]:
        """The prefillers whose KV can reach the decoder, with their readings (empty:
        none is known)."""
        return self.reads.prefillers()

    @property
    def peers(self) -> tuple[Candidate, ...]:
        """The other decoders the routing ranked that the same prefillers reach (the
        chosen decoder's compatibility class), best first, with their readings: where a
        request sent P/D at once may decode instead (empty for ask-all)."""
        return self.reads.peers()

    @property
    def cached_tokens(self) -> int | None:
        """The prompt tokens the chosen decoder holds in its prefix cache, by the
        gateway's prefix index (a precise one, from the servers' KV events), at most
        ``prompt_tokens``; None when unknown (no index, no token ids)."""
        return self.cached_on(self.decoder.endpoint)

    def cached_on(self, endpoint: Endpoint) -> int | None:
        """The same count for another endpoint (a prefiller), at most
        ``prompt_tokens``; None when unknown."""
        cached = self.reads.cached_tokens(endpoint)
        return None if cached is None else min(cached, self.prompt_tokens)


@record
class LatencyObservation:
    """Latencies the gateway measured for one finished request.

    ``pool`` and ``model``: where it was decoded (overrides route the observation
    to the policy that serves them). ``ttft``: seconds from arrival to the first
    content sent to the client. ``itl``: an inter-token latency in seconds (the
    request's mean gap between content chunks, or one gap). Either may be None.
    ``now``: when it was observed, on the clock of :attr:`ThresholdContext.now`.
    ``prompt_tokens`` and ``cached_tokens`` (of those, what the serving decoder had
    cached), ``output_tokens`` and ``remote`` (prefilled on a prefiller): what a cost
    model learns rates from (None: unknown). ``after_prefill``: of a P/D request,
    seconds from the prefill leg's answer to the first content sent (the hand-over,
    the decoder's first step and the decode leg's two hops; None: unknown).
    ``queued``: whether the endpoint that prefilled the prompt (the serving decoder,
    or the prefiller of a P/D request) had prompts queued ahead of it when the
    request was planned (None: unknown): such a TTFT times the queue as well as the
    engine.
    ``alone``: whether that endpoint had nothing else running or queued there when the
    request was planned, by the gateway's counts and a fresh reading, less the
    requests of the gateways' it counted when it was taken (None: unknown, or no fresh
    reading): such a TTFT times the engine alone, up to its jitter; one
    beside other work is slower by what that work took, a bound on the rate.
    ``prefill_cached``: of a P/D request, the prompt tokens the prefiller had cached
    (its answer's ``prompt_tokens_details``; None: not reported).
    ``prefill_seconds``: of a P/D request, seconds from the prefill leg's send to its
    answer (the prefill and its two hops, without what came before the leg: a
    decoder's rejection at its threshold; None: unknown).
    ``streams``: requests running at the serving decoder when the request was
    planned, itself not counted (None: unknown): the batch its ``itl`` was timed in,
    about.
    """

    model: str
    pool: str
    now: float
    ttft: float | None = None
    itl: float | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    output_tokens: int = 0
    remote: bool | None = None
    after_prefill: float | None = None
    queued: bool | None = None
    alone: bool | None = None
    prefill_cached: int | None = None
    prefill_seconds: float | None = None
    streams: int | None = None

    def __post_init__(self) -> None:
        timed = (
            ("ttft", self.ttft), ("itl", self.itl), ("after_prefill", self.after_prefill),
            ("prefill_seconds", self.prefill_seconds),
        )  # fmt: skip
        for name, value in timed:
            if value is not None and not (math.isfinite(value) and value >= 0.0):
                raise ValueError(f"{name} must be a finite number of seconds >= 0, got {value}")


class ThresholdPolicy(Protocol):
    """A threshold policy (see the module docstring)."""

    @property
    def name(self) -> str:
        """The instance name, the ``policy`` label of its routes."""
        ...

    @property
    def bounds(self) -> tuple[float, float]:
        """``(low, high)``: every threshold :meth:`decide` sends
        (:func:`~pd_orchestrator.model.route.threshold_of`) lies within them."""
        ...

    @property
    def parts(self) -> tuple[ThresholdPolicy, ...]:
        """The policies it composes (children, override rules, default); () for a leaf."""
        ...

    @property
    def ranks_spill(self) -> bool:
        """Whether the decode routing ranks the prefillers whose pool spills beside the
        decoders for it (it then decides for them too: :class:`ThresholdContext`). A
        declaration, not a read: it changes what the routing ranks before any policy is
        asked."""
        ...

    @property
    def observes(self) -> bool:
        """Whether :meth:`observe` learns anything. A declaration, as ``ranks_spill``:
        where no policy of the configuration observes, the planner builds no
        :class:`LatencyObservation` for a finished request."""
        ...

    def decide(self, context: ThresholdContext) -> Route:
        """The route for one request; it changes no state of the policy."""
        ...

    def chosen(self, context: ThresholdContext, route: Route) -> None:
        """The request :meth:`decide` answered for ``context`` takes ``route``, the final
        one (a composite's, the planner's): what a policy learns from its choices."""
        ...

    def observe(self, observation: LatencyObservation) -> None:
        """Learn from one finished request's latencies (most policies ignore them)."""
        ...


class Leaf:
    """A base for the policies that compose none, rank no spilling prefiller and learn
    nothing from their choices nor, unless they say so (``observes`` and their own
    :meth:`observe`), from latencies (:class:`ThresholdPolicy`'s ``parts``,
    ``ranks_spill``, ``chosen``, ``observes`` and ``observe``)."""

    __slots__ = ()
    parts: ClassVar[tuple[ThresholdPolicy, ...]] = ()
    ranks_spill: ClassVar[bool] = False
    observes: ClassVar[bool] = False

    def chosen(self, context: ThresholdContext, route: Route) -> None:
        return None

    def observe(self, observation: LatencyObservation) -> None:
        return None


POLICY: PluginKind[ThresholdPolicy] = PluginKind("policy")
"""The registry kind of threshold policies."""
