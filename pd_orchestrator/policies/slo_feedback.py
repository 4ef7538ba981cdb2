"""``slo-feedback``: steer the threshold towards latency targets.

The sign of the lever: a higher threshold sends more requests through P/D, so
decoders do less prefill between decode steps (lower inter-token latency, ITL)
at the cost of more KV transfers and of the prefill pool's queue in the time to
first token (TTFT). A lower threshold keeps more prefill on the decoders: worse
ITL, and a better TTFT when the prefill pool queues or the transfer dominates.

Control law, a bounded integral controller with a dead band. The gateway feeds
each finished request's TTFT and ITL (:meth:`SloFeedbackPolicy.observe`); the
policy keeps those of the last ``window`` seconds (at most ``max_samples`` each).
Every ``interval`` seconds (checked whenever it is called, on the callers' clock),
with ``P`` the TTFT p90 and ``I`` the ITL p99 of the window (nearest rank; a
metric with fewer than ``min_samples`` samples counts as unmeasured), the relative
errors ``e_I = I / itl_p99 - 1`` and ``e_T = P / ttft_p90 - 1`` move the threshold::

    e_I > tolerance                   ->  t += gain * min(1, e_I)     itl-over-target
    else e_T > tolerance              ->  t -= gain * min(1, e_T)     ttft-over-target
    else every measured e < -tolerance ->  t moves towards base by at most gain / 2
                                                                      relaxing
    else                              ->  t unchanged                 within-targets

then ``t`` is clamped to ``[floor, ceiling]``. ITL comes first: lowering the
threshold for TTFT while ITL is over target would worsen ITL further. With both
targets met with room to spare the threshold returns to the operator's ``base``,
so a transient does not leave it at an extreme. After a step that changes ``t``
the window restarts: the next step judges only latencies observed since the move
(no wind-up from samples the move already answered). Before the first step the
reason is ``warming-up``; a step without enough samples keeps the threshold and
the reason. A missing target (None) is never measured; at least one
target is required.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Annotated, ClassVar, Self

from pydantic import Field, model_validator

from pd_orchestrator.model.route import Route, at
from pd_orchestrator.policies.base import (
    POLICY,
    LatencyObservation,
    Leaf,
    ThresholdContext,
    clamp_ratio,
)
from pd_orchestrator.routing.interfaces import PluginContext
from pd_orchestrator.routing.registry import NoParams, PluginType

__all__ = ["SLO_FEEDBACK", "SloFeedbackParams", "SloFeedbackPolicy", "percentile"]

Ratio = Annotated[float, Field(ge=0.0, le=1.0, allow_inf_nan=False)]
Seconds = Annotated[float, Field(gt=0.0, allow_inf_nan=False)]


class SloFeedbackParams(NoParams):
    """Parameters of ``slo-feedback`` (defaults in brackets).

    ``ttft_p90`` [None], ``itl_p99`` [None]: the targets in seconds (at least one).
    ``base`` [0.7], ``floor`` [0.0], ``ceiling`` [0.95]: the starting threshold and
    its bounds. ``gain`` [0.05]: the largest move per step. ``tolerance`` [0.1]:
    the relative dead band around each target. ``interval`` [5 s]: time between
    steps. ``window`` [30 s, >= interval]: how old a sample may be.
    ``min_samples`` [20]: samples a metric needs to count as measured.
    ``max_samples`` [4096]: samples kept per metric.
    """

    ttft_p90: Seconds | None = None
    itl_p99: Seconds | None = None
    base: Ratio = 0.7
    floor: Ratio = 0.0
    ceiling: Ratio = 0.95
    gain: Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)] = 0.05
    tolerance: Annotated[float, Field(ge=0.0, lt=1.0, allow_inf_nan=False)] = 0.1
    interval: Seconds = 5.0
    window: Seconds = 30.0
    min_samples: Annotated[int, Field(ge=1)] = 20
    max_samples: Annotated[int, Field(ge=1)] = 4096

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if self.ttft_p90 is None and self.itl_p99 is None:
            raise ValueError("set at least one target: ttft_p90 or itl_p99 (seconds)")
        if not self.floor <= self.base <= self.ceiling:
            raise ValueError(
                f"need floor <= base <= ceiling, got {self.floor}, {self.base}, {self.ceiling}"
            )
        if self.window < self.interval:
            raise ValueError(f"window ({self.window}s) must be >= interval ({self.interval}s)")
        if self.min_samples > self.max_samples:
            raise ValueError("min_samples must not exceed max_samples")
        return self


def percentile(values: list[float], share: float) -> float:
    """The nearest-rank percentile (``share`` in (0, 1]) of non-empty ``values``."""
    ordered = sorted(values)
    rank = max(1, math.ceil(share * len(ordered)))
    return ordered[rank - 1]


@dataclass(slots=True)
class _Window:
    """Timestamped samples of one latency, newest last."""

    samples: deque[tuple[float, float]]

    def add(self, at: float, value: float) -> None:
        self.samples.append((at, value))

    def values(self, since: float) -> list[float]:
        while self.samples and self.samples[0][0] < since:
            self.samples.popleft()
        return [value for _, value in self.samples]

    def clear(self) -> None:
        self.samples.clear()


def _window(params: SloFeedbackParams) -> _Window:
    return _Window(deque(maxlen=params.max_samples))


@dataclass(slots=True)
class SloFeedbackPolicy(Leaf):
    """See the module docstring."""

    observes: ClassVar[bool] = True
    params: SloFeedbackParams
    name: str = "slo-feedback"
    threshold: float = field(init=False)
    reason: str = field(default="warming-up", init=False)
    _last_step: float | None = field(default=None, init=False, repr=False)
    _ttft: _Window = field(init=False, repr=False)
    _itl: _Window = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.threshold = self.params.base
        self._ttft = _window(self.params)
        self._itl = _window(self.params)

    @property
    def bounds(self) -> tuple[float, float]:
        return (self.params.floor, self.params.ceiling)

    def decide(self, context: ThresholdContext) -> Route:
        self.advance(context.now)
        return at(self.threshold, self.name, self.reason)

    def observe(self, observation: LatencyObservation) -> None:
        if observation.ttft is not None:
            self._ttft.add(observation.now, observation.ttft)
        if observation.itl is not None:
            self._itl.add(observation.now, observation.itl)
        self.advance(observation.now)

    def advance(self, now: float) -> None:
        """Run a control step if ``interval`` passed since the last one."""
        if self._last_step is None:
            self._last_step = now
            return
        if now - self._last_step < self.params.interval:
            return
        self._last_step = now
        before = self.threshold
        self.threshold, self.reason = self._step(now)
        if self.threshold != before:
            self._ttft.clear()
            self._itl.clear()

    def _errors(self, now: float) -> tuple[float | None, float | None]:
        """Relative errors ``(e_I, e_T)``; None: no target or too few samples."""
        since = now - self.params.window
        return (
            self._error(self._itl, self.params.itl_p99, 0.99, since),
            self._error(self._ttft, self.params.ttft_p90, 0.90, since),
        )

    def _error(
        self, window: _Window, target: float | None, share: float, since: float
    ) -> float | None:
        values = window.values(since)
        if target is None or len(values) < self.params.min_samples:
            return None
        return percentile(values, share) / target - 1.0

    def _step(self, now: float) -> tuple[float, str]:
        p = self.params
        e_itl, e_ttft = self._errors(now)
        t = self.threshold
        if e_itl is not None and e_itl > p.tolerance:
            return self._clamp(t + p.gain * min(1.0, e_itl)), "itl-over-target"
        if e_ttft is not None and e_ttft > p.tolerance:
            return self._clamp(t - p.gain * min(1.0, e_ttft)), "ttft-over-target"
        measured = [e for e in (e_itl, e_ttft) if e is not None]
        if not measured:
            return t, self.reason
        if all(e < -p.tolerance for e in measured) and t != p.base:
            step = max(-p.gain / 2, min(p.gain / 2, p.base - t))
            return self._clamp(t + step), "relaxing"
        return t, "within-targets"

    def _clamp(self, value: float) -> float:
        return clamp_ratio(value, self.params.floor, self.params.ceiling)


def _slo_feedback(params: SloFeedbackParams, context: PluginContext) -> SloFeedbackPolicy:
    return SloFeedbackPolicy(params, context.name)


SLO_FEEDBACK = PluginType("slo-feedback", POLICY, SloFeedbackParams, _slo_feedback)
