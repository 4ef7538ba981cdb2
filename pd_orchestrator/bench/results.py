"""What one benchmark run measured, and its summary.

Both runners (virtual and live) fill the same :class:`RunResult`: one
:class:`RequestRecord` per request plus fleet-wide counters. Times are in
simulated seconds (a live run divides its wall-clock readings by the simulators'
time scale). :func:`summarize` reduces a run to a :class:`Summary`:

* TTFT: arrival to the first content token the client received;
* ITL: every gap between two consecutive tokens of a request (``itl_p*`` are
  percentiles over all gaps of the run) and TPOT, a request's mean gap;
* goodput: requests per second (over the run's span) that met both SLOs
  (TTFT within :meth:`Slo.ttft_limit` of its prompt and TPOT <= ``Slo.tpot``),
  and their share;
* prefill tokens computed (not served from a cache, on any instance) and KV bytes
  moved between instances.
"""

from __future__ import annotations

import math
from array import array
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from pd_orchestrator.model.hardware import LatencyProfile
from pd_orchestrator.model.records import record

__all__ = ["RequestRecord", "RunResult", "Slo", "Summary", "percentile", "percentiles", "summarize"]


@record
class Slo:
    """Service-level objectives for goodput: TTFT and mean inter-token latency.

    With ``ttft_scale`` 0 (the default) every request's TTFT limit is ``ttft``. With
    ``ttft_scale`` k > 0 the limit scales with the prompt, as DistServe sets SLOs per
    application and Splitwise relative to the request alone: the larger of ``ttft``
    (the floor) and k times the prompt's isolated cold prefill on ``prefill`` (the
    fleet's prefill hardware; required then). ``attainment``: the share of requests
    the limits are to hold for (the goodput search's goal), which the ``goodput``
    policy is told as it is told the limits.
    """

    ttft: float = 2.0
    tpot: float = 0.05
    ttft_scale: float = 0.0
    prefill: LatencyProfile | None = None
    attainment: float = 0.9

    def __post_init__(self) -> None:
        if self.ttft <= 0 or self.tpot <= 0:
            raise ValueError("SLO limits must be > 0")
        if self.ttft_scale < 0:
            raise ValueError("the TTFT scale must be >= 0")
        if not 0.0 < self.attainment < 1.0:
            raise ValueError("the attainment must be within (0, 1)")
        if self.ttft_scale and self.prefill is None:
            raise ValueError("a TTFT limit that scales with the prompt needs a prefill profile")

    def ttft_limit(self, prompt_tokens: int) -> float:
        """The TTFT limit of a request of ``prompt_tokens`` (see the class docstring)."""
        if not self.ttft_scale or self.prefill is None:
            return self.ttft
        alone = self.prefill.prefill_seconds(prompt_tokens, 0)
        return max(self.ttft, self.ttft_scale * alone)

    def describe(self) -> str:
        """The TTFT and TPOT limits in words, e.g. ``TTFT <= max(1s, 3 x prefill
        alone on h200), TPOT <= 30ms``."""
        ttft = f"{self.ttft:g}s"
        if self.ttft_scale and self.prefill is not None:
            ttft = f"max({ttft}, {self.ttft_scale:g} x prefill alone on {self.prefill.name})"
        return f"TTFT <= {ttft}, TPOT <= {self.tpot * 1000:g}ms"


@dataclass(slots=True)
class RequestRecord:
    """One request's outcome; ``error`` set means it failed (no latencies)."""

    index: int
    session: str
    arrival: float
    prompt_tokens: int
    decision: str = ""
    decoder: str = ""
    prefiller: str | None = None
    output_tokens: int = 0
    cached_tokens: int = 0
    ttft: float | None = None
    e2e: float | None = None
    tpot: float | None = None
    threshold: float | None = None
    handbacks: int = 0
    kv_bytes: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.ttft is not None and self.e2e is not None

    def meets(self, slo: Slo) -> bool:
        """Whether the request completed within both SLOs."""
        if not self.ok or self.ttft is None:
            return False
        limit = slo.ttft_limit(self.prompt_tokens)
        return self.ttft <= limit and (self.tpot is None or self.tpot <= slo.tpot)


@dataclass
class RunResult:
    """Everything one strategy's run measured."""

    strategy: str
    mode: str
    workload: str
    fleet: str
    runner: str
    records: list[RequestRecord]
    itl_samples: array[float] = field(default_factory=lambda: array("d"))
    prefill_tokens: int = 0
    kv_bytes: int = 0
    preemptions: int = 0
    wall_seconds: float = 0.0
    reasons: dict[str, int] = field(default_factory=dict)
    """Threshold decisions by ``policy:reason`` (virtual runs)."""
    busy_seconds: dict[str, tuple[float, int]] = field(default_factory=dict)
    """Per pool: engine-seconds spent stepping and the pool's instance count (virtual)."""

    def busy(self) -> dict[str, float]:
        """Per pool: the share of the run's span its instances spent stepping (0..1)."""
        span = self.span
        if span <= 0:
            return {}
        return {
            pool: seconds / (count * span) for pool, (seconds, count) in self.busy_seconds.items()
        }

    @property
    def span(self) -> float:
        """Simulated seconds from the first arrival to the last completion."""
        ends = [r.arrival + r.e2e for r in self.records if r.e2e is not None]
        if not ends:
            return 0.0
        return max(ends) - min(r.arrival for r in self.records)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100, linear interpolation); None for no values."""
    return percentiles(values, (q,))[0]


def percentiles(values: Sequence[float], qs: Sequence[float]) -> list[float | None]:
    """Several percentiles of ``values`` with one sort (each None for no values)."""
    if not values:
        return [None] * len(qs)
    ordered = sorted(values)
    return [_interpolate(ordered, q) for q in qs]


def _interpolate(ordered: Sequence[float], q: float) -> float:
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@record
class Summary:
    """A run reduced to the figures the report shows (times in seconds)."""

    strategy: str
    mode: str
    runner: str
    requests: int
    completed: int
    errors: int
    ttft_p50: float | None
    ttft_p90: float | None
    ttft_p99: float | None
    itl_p50: float | None
    itl_p99: float | None
    tpot_p50: float | None
    e2e_p50: float | None
    e2e_p99: float | None
    goodput: float
    slo_share: float
    decisions: dict[str, int]
    reasons: dict[str, int]
    threshold_p10: float | None
    threshold_p50: float | None
    threshold_p90: float | None
    handbacks: int
    prefill_tokens: int
    kv_bytes: int
    preemptions: int
    span: float
    wall_seconds: float
    busy: dict[str, float] = field(default_factory=dict)


def summarize(result: RunResult, slo: Slo) -> Summary:
    """The :class:`Summary` of ``result`` under ``slo``."""
    done = [r for r in result.records if r.ok]
    ttfts = [r.ttft for r in done if r.ttft is not None]
    e2es = [r.e2e for r in done if r.e2e is not None]
    tpots = [r.tpot for r in done if r.tpot is not None]
    met = sum(r.meets(slo) for r in result.records)
    span = result.span
    itl_p50, itl_p99 = percentiles(result.itl_samples, (50, 99))
    ttft_p50, ttft_p90, ttft_p99 = percentiles(ttfts, (50, 90, 99))
    e2e_p50, e2e_p99 = percentiles(e2es, (50, 99))
    thresholds = [r.threshold for r in result.records if r.threshold is not None]
    threshold_p10, threshold_p50, threshold_p90 = percentiles(thresholds, (10, 50, 90))
    return Summary(
        strategy=result.strategy,
        mode=result.mode,
        runner=result.runner,
        requests=len(result.records),
        completed=len(done),
        errors=sum(r.error is not None for r in result.records),
        ttft_p50=ttft_p50,
        ttft_p90=ttft_p90,
        ttft_p99=ttft_p99,
        itl_p50=itl_p50,
        itl_p99=itl_p99,
        tpot_p50=percentile(tpots, 50),
        e2e_p50=e2e_p50,
        e2e_p99=e2e_p99,
        busy=result.busy(),
        goodput=met / span if span > 0 else 0.0,
        slo_share=met / len(result.records) if result.records else 0.0,
        decisions=dict(sorted(Counter(r.decision for r in done).items())),
        reasons=dict(sorted(result.reasons.items())),
        threshold_p10=threshold_p10,
        threshold_p50=threshold_p50,
        threshold_p90=threshold_p90,
        handbacks=sum(r.handbacks for r in result.records),
        prefill_tokens=result.prefill_tokens,
        kv_bytes=result.kv_bytes,
        preemptions=result.preemptions,
        span=span,
        wall_seconds=result.wall_seconds,
    )
