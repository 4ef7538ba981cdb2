"""Goodput as the field measures it (DistServe): the highest arrival rate at which a
given share of requests -- the attainment goal, 90% by default -- meets both SLOs,
TTFT and TPOT, each request on its own.

The rate is a multiplier of the workload's own arrival rate (its arrival and think
times divided by it: :func:`scaled`). :func:`search` finds the highest multiplier
whose run meets the goal: a geometric sweep from ``start`` (up by ``factor`` while
runs pass, down while they fail) brackets it between a passing and a failing
multiplier, then bisection (geometric) narrows the bracket; every probe is one run
of the strategy over the whole workload in virtual time. Attainment is not strictly
monotonic in the rate (a run's luck with the trace's bursts), so the answer is the
highest multiplier *seen* passing, and every probe is kept for the
attainment-against-rate plot. A probe may pool runs over several seeds of a
workload (:func:`pooled`), so that one draw's luck does not decide a comparison.

Pure apart from the runs ``probe`` makes: no clock, no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace

from pd_orchestrator.bench.workloads import Workload
from pd_orchestrator.model.records import record

__all__ = ["GoodputSearch", "Probe", "SearchSettings", "pooled", "scaled", "search"]


@record
class Probe:
    """One run at ``multiplier`` times the workload's rate: the share of requests
    that met the SLO, the requests served per second over the run's span, and each
    pool's busy fraction (pool name -> 0..1); ``runs``: how many runs (one per seed of
    the workload) it pools."""

    multiplier: float
    attainment: float
    rate: float
    busy: dict[str, float]
    runs: int = 1


@record
class SearchSettings:
    """``goal``: the attainment to meet; ``start``: the first multiplier; ``factor``:
    the sweep's step; ``bisections``: steps after bracketing; ``floor``/``ceiling``:
    the multipliers the sweep stops at (goodput 0 below the floor)."""

    goal: float = 0.9
    start: float = 1.0
    factor: float = 2.0
    bisections: int = 4
    floor: float = 1 / 64
    ceiling: float = 64.0

    def __post_init__(self) -> None:
        if not 0.0 < self.goal <= 1.0:
            raise ValueError("the attainment goal is in (0, 1]")
        if self.factor <= 1.0 or self.start <= 0.0 or not self.floor <= self.start <= self.ceiling:
            raise ValueError("need factor > 1 and floor <= start <= ceiling")


@record
class GoodputSearch:
    """The answer: ``multiplier`` (0.0 when even the floor fails), the probe at it
    (None then) and every probe, by multiplier."""

    multiplier: float
    best: Probe | None
    probes: tuple[Probe, ...]


def scaled(workload: Workload, multiplier: float) -> Workload:
    """``workload`` arriving ``multiplier`` times as fast (arrival and think times
    divided by it)."""
    if multiplier == 1.0:
        return workload
    requests = tuple(
        replace(r, arrival=r.arrival / multiplier, think_time=r.think_time / multiplier)
        for r in workload.requests
    )
    return replace(workload, requests=requests)


def pooled(probes: Sequence[Probe], requests: Sequence[int]) -> Probe:
    """One probe from probes at the same multiplier over ``requests[i]`` requests
    each: the attainment of all their requests together, and the rate and each
    pool's busy fraction averaged over the runs they pool (a pool a probe lacks was
    idle in it). ``ValueError`` for no probes, probes at different multipliers, or a
    count per probe missing."""
    if not probes or len(probes) != len(requests):
        raise ValueError("pool one or more runs, each with its request count")
    multipliers = {p.multiplier for p in probes}
    if len(multipliers) != 1:
        raise ValueError(f"runs at different multipliers: {sorted(multipliers)}")
    total = sum(requests)
    met = sum(p.attainment * n for p, n in zip(probes, requests, strict=True))
    pools = sorted({pool for p in probes for pool in p.busy})
    runs = sum(p.runs for p in probes)
    return Probe(
        multiplier=probes[0].multiplier,
        attainment=met / total if total else 0.0,
        rate=sum(p.rate * p.runs for p in probes) / runs,
        busy={pool: sum(p.busy.get(pool, 0.0) * p.runs for p in probes) / runs for pool in pools},
        runs=runs,
    )


def search(probe: Callable[[float], Probe], settings: SearchSettings) -> GoodputSearch:
    """The highest multiplier whose probe meets ``settings.goal`` (module docstring)."""
    seen: dict[float, Probe] = {}

    def passes(multiplier: float) -> bool:
        if multiplier not in seen:
            seen[multiplier] = probe(multiplier)
        return seen[multiplier].attainment >= settings.goal

    low, high = _bracket(passes, settings)
    if low is not None and high is not None:
        for _ in range(settings.bisections):
            middle = math.sqrt(low * high)
            if passes(middle):
                low = middle
            else:
                high = middle
    passing = [p for p in seen.values() if p.attainment >= settings.goal]
    best = max(passing, key=lambda p: p.multiplier, default=None)
    probes = tuple(sorted(seen.values(), key=lambda p: p.multiplier))
    return GoodputSearch(best.multiplier if best else 0.0, best, probes)


def _bracket(
    passes: Callable[[float], bool], settings: SearchSettings
) -> tuple[float | None, float | None]:
    """A passing and a failing multiplier a factor apart (None where the sweep hit
    the floor or the ceiling first)."""
    multiplier = settings.start
    if passes(multiplier):
        while multiplier < settings.ceiling:
            above = multiplier * settings.factor
            if not passes(above):
                return multiplier, above
            multiplier = above
        return multiplier, None
    while multiplier > settings.floor:
        below = multiplier / settings.factor
        if passes(below):
            return below, multiplier
        multiplier = below
    return None, multiplier
