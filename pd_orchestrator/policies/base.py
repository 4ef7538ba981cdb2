"""The threshold policy interface: what a policy sees, what it returns, what it learns.

A policy maps a :class:`ThresholdContext` (the request's model and size, the
chosen decoder with its load, the compatible prefillers with theirs, the client's
own threshold, the clock) to a :class:`ThresholdDecision`: the threshold sent on
the decode attempt, the policy that set it and a short reason. The decoder admits
a request iff its prefix-cache hit ratio (cached tokens / prompt tokens) is at
least the threshold, so a higher threshold sends more requests through P/D and a
lower one keeps more prefill on the decoder.

Policies do no I/O and read no clock but ``context.now``. Some keep state (a
smoothed value, a window of latencies); their output is then a deterministic
function of the sequence of calls they received (:meth:`ThresholdPolicy.decide`
and :meth:`ThresholdPolicy.observe`), so a replay of one sequence decides alike.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from pd_orchestrator.model.endpoints import Endpoint
from pd_orchestrator.model.load import Candidate, LoadSnapshot
from pd_orchestrator.routing.registry import PluginKind

__all__ = [
    "POLICY",
    "LatencyObservation",
    "ThresholdContext",
    "ThresholdDecision",
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


@dataclass(frozen=True, slots=True)
class ThresholdContext:
    """What a policy may look at for one request.

    ``model``: the requested model. ``decoder``: the chosen decoder (its endpoint
    names the pool; ``in_flight`` counts the gateway's own requests on it; ``load``
    is its latest fresh reading, None when stale or never read). For a policy that
    declares ``reads_spill`` it may be a prefiller whose pool spills, which the
    decode routing ranked beside the decoders: a decision of 0 serves the request
    whole there, any other declines it (the planner then asks about a decoder).
    ``prompt_tokens``: the prompt's length in tokens, exact or estimated from
    ``prompt_chars`` (:class:`~pd_orchestrator.policies.estimator.PromptLengthEstimator`).
    ``prefillers``: the prefillers whose KV can reach the decoder, with their
    readings (empty: none is known). ``client_threshold``: the request's own
    ``cache_hit_threshold``, if any. ``now``: the caller's clock, the one load
    readings are stamped with. ``peers``: the other decoders the routing ranked that
    the same prefillers reach (the chosen decoder's compatibility class), best first,
    with their readings: where a request sent P/D at once may decode instead (empty
    for ask-all and unless a policy declares ``reads_peers``). ``cached_tokens``: the
    prompt tokens the chosen decoder holds in its prefix cache, by the gateway's
    prefix index (a precise one, from the servers' KV events), at most
    ``prompt_tokens``; None when unknown (no index, no token ids, or no policy
    declares ``reads_cache``). ``cached_on``: the same count for another endpoint (a
    prefiller), by the same index; None when the planner has no index or no policy
    reads it.
    """

    model: str
    decoder: Candidate
    prompt_tokens: int
    prompt_chars: int = 0
    prefillers: tuple[Candidate, ...] = ()
    client_threshold: float | None = None
    now: float = 0.0
    peers: tuple[Candidate, ...] = ()
    cached_tokens: int | None = None
    cached_on: Callable[[Endpoint], int | None] | None = None

    def __post_init__(self) -> None:
        if self.prompt_tokens < 0 or self.prompt_chars < 0:
            raise ValueError("prompt_tokens and prompt_chars must be >= 0")
        if self.cached_tokens is not None and not 0 <= self.cached_tokens <= self.prompt_tokens:
            raise ValueError("cached_tokens must be within [0, prompt_tokens]")
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


@dataclass(frozen=True, slots=True)
class ThresholdDecision:
    """A threshold in [0, 1], the policy (instance name) that set it and a short,
    stable reason usable as a metric label (``fixed``, ``decoder-busy``...).
    ``admission_only``: the decoder applies it at admission only (it never hands the
    request back; set by the planner for requests a continuation cannot honour).
    ``decoder``: where the request goes instead of the chosen decoder (None: the chosen
    one). With a threshold of 1 (no decoder admits: P/D at once), one of
    :attr:`ThresholdContext.peers`: a request that skips the decode attempt needs no
    prefix of the decoder's own, so its decode leg may go where it starts soonest.
    With a threshold of 0 (served whole), one of :attr:`ThresholdContext.prefillers`
    whose pool spills (:attr:`~pd_orchestrator.model.endpoints.Endpoint.spill`): it
    prefills and decodes the request itself, off the crowded decoders."""

    value: float
    policy: str
    reason: str
    admission_only: bool = False
    decoder: str | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.value <= 1.0:
            raise ValueError(f"threshold {self.value} is outside [0, 1] ({self.policy})")
        if self.decoder is not None and 0.0 < self.value < 1.0:
            raise ValueError(f"only a threshold of 0 or 1 names a decoder ({self.policy})")


@dataclass(frozen=True, slots=True)
class LatencyObservation:
    """Latencies the gateway measured for one finished request.

    ``pool`` and ``model``: where it was decoded (overrides route the observation
    to the policy that serves them). ``ttft``: seconds from arrival to the first
    content sent to the client. ``itl``: an inter-token latency in seconds (the
    request's mean gap between content chunks, or one gap). Either may be None.
    ``now``: when it was observed, on the clock of :attr:`ThresholdContext.now`.
    ``prompt_tokens`` and ``cached_tokens`` (of those, what the serving decoder had
    cached), ``output_tokens`` and ``remote`` (prefilled on a prefiller): what a cost
    model learns rates from (None: unknown).
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

    def __post_init__(self) -> None:
        for name, value in (("ttft", self.ttft), ("itl", self.itl)):
            if value is not None and not (math.isfinite(value) and value >= 0.0):
                raise ValueError(f"{name} must be a finite number of seconds >= 0, got {value}")


class ThresholdPolicy(Protocol):
    """A threshold policy (see the module docstring)."""

    @property
    def name(self) -> str:
        """The instance name, the ``policy`` label of its decisions."""
        ...

    @property
    def bounds(self) -> tuple[float, float]:
        """``(low, high)``: every value :meth:`decide` returns lies within them."""
        ...

    def decide(self, context: ThresholdContext) -> ThresholdDecision:
        """The threshold for one request."""
        ...

    def observe(self, observation: LatencyObservation) -> None:
        """Learn from one finished request's latencies (most policies ignore them)."""
        ...


POLICY: PluginKind[ThresholdPolicy] = PluginKind("policy")
"""The registry kind of threshold policies."""
