"""``load-adaptive``: move the threshold with the decoder's and the prefill pool's load.

Two pressures in [0, 1], from the scraped readings and the gateway's own counts:

- decoder pressure ``d``, of the chosen decoder: the largest of
  ``ramp(depth, 0, decoder_requests_full)``, ``ramp(waiting, 0, decoder_waiting_full)``
  and ``ramp(kv_usage, kv_usage_low, kv_usage_high)``, where ``depth`` is running +
  waiting, or the gateway's in-flight count when larger (a reading is up to a poll
  old). Without a reading only the in-flight term counts.
- prefill queueing ``q``: ``ramp(shallowest queue, 0, prefill_waiting_full)`` over
  the healthy compatible prefillers, a prefiller's queue being its reading's
  ``waiting`` (its in-flight count without a reading). The shallowest counts
  because the prefill profile picks the least loaded. No healthy prefiller: ``q = 1``.

``ramp(x, a, b)`` is 0 up to ``a``, 1 from ``b``, linear between. The target is::

    target = clamp(base + raise_by * d * (1 - q) - lower_by * q, floor, ceiling)

A busy decoder with an idle prefill pool raises the threshold (push prefill away);
a queueing prefill pool lowers it (prefill locally), whatever the decoder, since
sending more work to a queue only adds waiting.

Per decoder, the target is smoothed exponentially in time: the first request
takes it as is; then ``s += (1 - exp(-dt / smoothing_seconds)) * (target - s)``
with ``dt`` the time since that decoder's previous request, and ``s`` takes the
target outright once within ``dead_band`` of it (so a threshold can settle at
exactly 0, the only value that admits a prompt with no cached token). The value
sent moves to ``s`` only when ``|s - sent| >= dead_band``, so a steady load gives a steady
threshold (once ``s`` settles within the band the value stops changing) and noise
smaller than the band never moves it. All values stay in ``[floor, ceiling]``.

Reasons: ``decoder-busy`` (the value is above ``base``), ``prefill-queueing``
(below it), ``no-prefiller`` (below it for want of a healthy prefiller),
``balanced`` (at ``base``, within half the dead band).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Annotated, Self

from pydantic import Field, model_validator

from pd_orchestrator.model.load import Candidate
from pd_orchestrator.model.route import Route, at
from pd_orchestrator.policies.base import (
    POLICY,
    Leaf,
    ThresholdContext,
    clamp_ratio,
    ramp,
)
from pd_orchestrator.routing.interfaces import PluginContext
from pd_orchestrator.routing.registry import NoParams, PluginType
from pd_orchestrator.routing.scorers import queue_depth

__all__ = [
    "LOAD_ADAPTIVE",
    "LoadAdaptiveParams",
    "LoadAdaptivePolicy",
    "decoder_pressure",
    "prefill_queueing",
]

Ratio = Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)]


class LoadAdaptiveParams(NoParams):
    """Parameters of ``load-adaptive`` (defaults in brackets).

    ``base`` [0.7], ``floor`` [0.0], ``ceiling`` [0.95]: the threshold without
    pressure and its bounds (``floor <= base <= ceiling``). ``raise_by`` [0.25]: the
    rise at full decoder pressure with an idle prefill pool. ``lower_by`` [0.7]: the
    fall at full prefill queueing. ``decoder_requests_full`` [64],
    ``decoder_waiting_full`` [4], ``kv_usage_low`` [0.5], ``kv_usage_high`` [0.9]: the
    decoder pressure ramps. ``prefill_waiting_full`` [8]: the prefill queue ramp.
    ``smoothing_seconds`` [5.0; 0: none]: the smoothing time constant.
    ``dead_band`` [0.02]: the smallest move of the value sent.
    """

    base: Ratio = 0.7
    floor: Ratio = 0.0
    ceiling: Ratio = 0.95
    raise_by: Ratio = 0.25
    lower_by: Ratio = 0.7
    decoder_requests_full: Annotated[int, Field(ge=1)] = 64
    decoder_waiting_full: Annotated[int, Field(ge=1)] = 4
    kv_usage_low: Ratio = 0.5
    kv_usage_high: Ratio = 0.9
    prefill_waiting_full: Annotated[int, Field(ge=1)] = 8
    smoothing_seconds: Annotated[float, Field(ge=0.0, allow_inf_nan=False)] = 5.0
    dead_band: Annotated[float, Field(ge=0.0, le=0.5, allow_inf_nan=False)] = 0.02

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if not self.floor <= self.base <= self.ceiling:
            raise ValueError(
                f"need floor <= base <= ceiling, got {self.floor}, {self.base}, {self.ceiling}"
            )
        if self.kv_usage_low >= self.kv_usage_high:
            raise ValueError("kv_usage_low must be below kv_usage_high")
        return self


def decoder_pressure(decoder: Candidate, params: LoadAdaptiveParams) -> float:
    """``d`` of the module docstring."""
    depth = ramp(queue_depth(decoder), 0.0, params.decoder_requests_full)
    load = decoder.load
    if load is None:
        return depth
    waiting = ramp(load.waiting, 0.0, params.decoder_waiting_full)
    kv = ramp(load.kv_usage, params.kv_usage_low, params.kv_usage_high)
    return max(depth, waiting, kv)


def prefill_queueing(prefillers: Sequence[Candidate], params: LoadAdaptiveParams) -> float:
    """``q`` of the module docstring."""
    queues = [p.in_flight if p.load is None else p.load.waiting for p in prefillers if p.healthy]
    if not queues:
        return 1.0
    return ramp(min(queues), 0.0, params.prefill_waiting_full)


@dataclass(slots=True)
class _Track:
    """The smoothed target of one decoder, the value last sent and when."""

    smoothed: float
    sent: float
    at: float


@dataclass(slots=True)
class LoadAdaptivePolicy(Leaf):
    """See the module docstring; state: one :class:`_Track` per decoder name."""

    params: LoadAdaptiveParams
    name: str = "load-adaptive"
    _tracks: dict[str, _Track] = field(default_factory=dict, init=False, repr=False)

    @property
    def bounds(self) -> tuple[float, float]:
        return (self.params.floor, self.params.ceiling)

    def target(self, context: ThresholdContext) -> float:
        """The unsmoothed target for ``context``."""
        p = self.params
        d = decoder_pressure(context.decoder, p)
        q = prefill_queueing(context.prefillers, p)
        raw = p.base + p.raise_by * d * (1.0 - q) - p.lower_by * q
        return clamp_ratio(raw, p.floor, p.ceiling)

    def decide(self, context: ThresholdContext) -> Route:
        value = self._smooth(context.decoder.endpoint.name, self.target(context), context.now)
        return at(value, self.name, self._reason(value, context))

    def _smooth(self, decoder: str, target: float, now: float) -> float:
        track = self._tracks.get(decoder)
        if track is None:
            self._tracks[decoder] = _Track(target, target, now)
            return target
        tau = self.params.smoothing_seconds
        dt = max(0.0, now - track.at)
        weight = 1.0 if tau == 0.0 else 1.0 - math.exp(-dt / tau)
        track.smoothed += weight * (target - track.smoothed)
        if abs(target - track.smoothed) < self.params.dead_band:
            track.smoothed = target  # settle: an exponential never reaches its target
        track.at = max(track.at, now)
        if abs(track.smoothed - track.sent) >= self.params.dead_band:
            track.sent = track.smoothed
        return clamp_ratio(track.sent, self.params.floor, self.params.ceiling)

    def _reason(self, value: float, context: ThresholdContext) -> str:
        margin = self.params.dead_band / 2
        if value > self.params.base + margin:
            return "decoder-busy"
        if value < self.params.base - margin:
            if not any(p.healthy for p in context.prefillers):
                return "no-prefiller"
            return "prefill-queueing"
        return "balanced"


def _load_adaptive(params: LoadAdaptiveParams, context: PluginContext) -> LoadAdaptivePolicy:
    return LoadAdaptivePolicy(params, context.name)


LOAD_ADAPTIVE = PluginType("load-adaptive", POLICY, LoadAdaptiveParams, _load_adaptive)
