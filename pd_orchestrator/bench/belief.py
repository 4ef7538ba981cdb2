"""A wrong belief on purpose: the ``goodput`` policy started from a profile that is off.

``--profile-error prefill=2,transfer=5`` (:class:`ProfileError`) multiplies what
the cost model believes, never the simulated truth: ``prefill`` the prefill rates
each pool is seeded with (its local and remote rate and the seed the plausibility
bound reads; the attention term divided by it, so every prefill looks ``prefill``
times faster: 2 is a profile twice too optimistic), ``transfer`` the KV transfer
rate it prices a hand-over at (5: the link is 5 times slower than it believes).
The policy then learns from traffic as it would on a deployment it misjudged; the
attainment per window of time (:func:`attainment_windows`) shows whether and how
soon it recovers.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence

from pd_orchestrator.bench.results import RunResult, Slo
from pd_orchestrator.bench.strategies import Strategy
from pd_orchestrator.model.endpoints import Endpoint
from pd_orchestrator.model.records import record
from pd_orchestrator.policies.base import ThresholdPolicy
from pd_orchestrator.policies.goodput import GoodputPolicy

__all__ = ["ProfileError", "Window", "attainment_windows", "misjudges", "windows_rows"]

_FACTORS = ("prefill", "transfer")


@record
class ProfileError:
    """Factors on the ``goodput`` policy's belief (see the module docstring); 1: right."""

    prefill: float = 1.0
    transfer: float = 1.0

    def __post_init__(self) -> None:
        for name in _FACTORS:
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"profile error {name}={value}: a factor must be > 0")

    @classmethod
    def parse(cls, text: str) -> ProfileError:
        """``prefill=F,transfer=G`` (either or both; ``ValueError`` on anything else)."""
        factors: dict[str, float] = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            name, sep, value = item.partition("=")
            if not sep or name.strip() not in _FACTORS:
                raise ValueError(f"profile error {item!r}: expected prefill=F or transfer=F")
            try:
                factors[name.strip()] = float(value)
            except ValueError:
                raise ValueError(f"profile error {item!r}: {value!r} is not a number") from None
        return cls(**factors)

    def describe(self) -> str:
        """``prefill x2, transfer x5`` (the factors that are not 1), ``right`` when none."""
        parts = [f"{n} x{getattr(self, n):g}" for n in _FACTORS if getattr(self, n) != 1.0]
        return ", ".join(parts) or "right"

    def apply(self, policy: ThresholdPolicy, endpoints: Iterable[Endpoint]) -> int:
        """Misjudge every ``goodput`` policy in ``policy`` (itself or its parts) for the
        pools of ``endpoints``: their models are seeded now, then scaled. Returns how
        many policies it changed (0: no ``goodput`` policy, nothing to misjudge)."""
        changed = 0
        for goodput in _goodput_policies(policy):
            transfer = goodput.params.transfer_tokens_per_s
            if transfer is not None:
                update = {"transfer_tokens_per_s": transfer * self.transfer}
                params = goodput.params.model_copy(update=update)
                goodput.params = goodput.model.params = params
            pools = {e.pool: goodput.model.pool(e) for e in endpoints}
            for pool in pools.values():
                if transfer is None:  # the pool's hand-over: its per-token part is the link's
                    pool.handover.slope /= self.transfer
                pool.rate_local *= self.prefill
                pool.rate_remote *= self.prefill
                pool.seed *= self.prefill
                pool.attn /= self.prefill
            changed += 1
        return changed


def misjudges(strategy: Strategy) -> bool:
    """Whether ``strategy``'s policy has a ``goodput`` part, whose belief
    :meth:`ProfileError.apply` would change."""
    resolver = strategy.resolver()
    return resolver is not None and any(_goodput_policies(resolver.policy))


def _goodput_policies(policy: ThresholdPolicy) -> Iterator[GoodputPolicy]:
    if isinstance(policy, GoodputPolicy):
        yield policy
    for part in policy.parts:
        yield from _goodput_policies(part)


@record
class Window:
    """Requests that arrived in ``[start, start + length)`` (seconds of the run) and the
    share of them within the SLO (failed ones count as missed)."""

    start: float
    length: float
    requests: int
    attainment: float


def attainment_windows(result: RunResult, slo: Slo, length: float) -> list[Window]:
    """``result``'s requests by arrival in consecutive windows of ``length`` seconds
    from the first arrival, each with its attainment; windows with no arrival are
    left out."""
    if length <= 0:
        raise ValueError("a window lasts > 0 seconds")
    records = result.records
    if not records:
        return []
    first = min(r.arrival for r in records)
    counts: dict[int, list[int]] = {}
    for one in records:
        slot = counts.setdefault(int((one.arrival - first) // length), [0, 0])
        slot[0] += 1
        slot[1] += one.meets(slo)
    return [
        Window(first + k * length, length, total, met / total)
        for k, (total, met) in sorted(counts.items())
    ]


def windows_rows(results: Sequence[RunResult], slo: Slo, length: float) -> list[list[str]]:
    """A table of the attainment per window (rows) of each of ``results`` (columns):
    the window's start and end in seconds, then each run's attainment in % and its
    request count."""
    per_run = [{w.start: w for w in attainment_windows(r, slo, length)} for r in results]
    starts = sorted({start for run in per_run for start in run})
    rows = []
    for start in starts:
        cells = [f"{start:.0f}-{start + length:.0f}s"]
        for run in per_run:
            window = run.get(start)
            cells.append(
                "-" if window is None else f"{100 * window.attainment:.1f}% ({window.requests})"
            )
        rows.append(cells)
    return rows
