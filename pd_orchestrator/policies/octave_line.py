"""A cost that grows along a line, ``y(x) = fixed + x * slope``, learnt robustly
from samples.

The ``goodput`` model learns two such costs: the P/D hand-over against the prompt's
length (seconds from the prefill leg's answer until the decoder's first token: the
KV's transfer and the orchestration around it; a published NIXL hand-over took
~200 ms p50, of which the transfer was ~30 ms, so learnt as one rate a fixed cost
would make short prompts look cheap to send and long ones dear), and, where no
profile is known, a decode step against the streams in its batch (the weights read
once a step, the KV read per stream).

The samples are kept per octave of ``x`` (``x`` in ``[2^(k-1), 2^k)``), each octave a
bounded moving mean of its samples and of their ``x``, and ``(fixed, slope)`` is the
non-negative least-squares line through the octaves (with one octave only, the
slope stays and the fixed part takes the rest, or, when the rest is negative, no
fixed part and the slope all of it).

Robust: a sample is first clipped into ``[v / k, k * v]`` of its octave's mean ``v``
(``k`` = :data:`MAX_STEP`), then moves it by ``alpha`` of the way; an octave starts
from the current line's estimate (from its first sample while the line is still 0,
as a line with no seed is), so no one sample, however far off, moves an estimate by
more than ``alpha * (k - 1)`` of it once there is one.

With ``recent`` N above 0, an octave is instead the median of its last N samples,
each clipped as above, and of the line's estimate it started from until N samples
have come: one sample moves it by at most ``(k - 1) / 2`` of it, far samples fewer
than half of them leave it within the range of the rest, and a line off by a factor
follows the samples within a few times ``log(factor) / log(k)`` of them, where a moving mean
takes ``log(factor) / log(1 + alpha * (k - 1))`` (the hand-over of a link five
times slower than believed: 65 samples in each octave at ``alpha`` 0.05; in the
octave of 40k-token prompts, which few requests reach, four minutes of Mooncake
traffic). Pure: no clock, no I/O.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

from pd_orchestrator.model.measured import nonnegative_least_squares

__all__ = ["MAX_STEP", "OctaveLine"]

MAX_STEP = 1.5
"""The most one sample may multiply or divide its octave's mean by before averaging."""


@dataclass(slots=True)
class OctaveLine:
    """``fixed`` and ``slope`` (module docstring); ``octaves``: per octave of ``x``,
    the moving means ``[x, y]`` of its samples (with ``recent``: their mean ``x`` and
    median ``y``, of the samples kept in ``kept``)."""

    fixed: float = 0.0
    slope: float = 0.0
    octaves: dict[int, list[float]] = field(default_factory=dict)
    recent: int = 0
    kept: dict[int, list[tuple[float, float]]] = field(default_factory=dict)

    def at(self, x: float) -> float:
        """``y(x)``."""
        return self.fixed + x * self.slope

    def learn(self, x: int, y: float, alpha: float) -> None:
        """Take one sample ``y`` at ``x`` (ignored unless both are positive and
        finite)."""
        if not _usable(x, y):
            return
        key = x.bit_length()
        octave = self.octaves.get(key)
        if octave is None:
            octave = self.octaves[key] = [float(x), self.at(x) or y]
        mean = octave[1]
        y = min(max(y, mean / MAX_STEP), mean * MAX_STEP)
        if self.recent > 0:
            self._keep(key, octave, float(x), y)
        else:
            octave[0] += alpha * (x - octave[0])
            octave[1] += alpha * (y - mean)
        self._refit()

    def place(self, x: int, y: float) -> None:
        """Set the octave of ``x`` to ``(x, y)`` outright, forgetting its samples: a
        value measured apart from the samples (ignored unless both are positive and
        finite)."""
        if not _usable(x, y):
            return
        key = x.bit_length()
        self.octaves[key] = [float(x), y]
        self.kept.pop(key, None)
        self._refit()

    def _keep(self, key: int, octave: list[float], x: float, y: float) -> None:
        """``octave`` (of key ``key``) after a clipped sample ``(x, y)``: its last
        ``recent`` samples (after the estimate it started from), their mean ``x``,
        median ``y``."""
        kept = self.kept.setdefault(key, [(octave[0], octave[1])])
        kept.append((x, y))
        del kept[: -self.recent]
        octave[0] = statistics.fmean(point[0] for point in kept)
        octave[1] = statistics.median(point[1] for point in kept)

    def _refit(self) -> None:
        means = list(self.octaves.values())
        if len(means) == 1:
            x, y = means[0]
            self.fixed = max(y - x * self.slope, 0.0)
            if self.fixed == 0.0:
                self.slope = y / x
            return
        rows = [[1.0, x] for x, _ in means]
        self.fixed, self.slope = nonnegative_least_squares(rows, [y for _, y in means])


def _usable(x: int, y: float) -> bool:
    """Whether ``(x, y)`` may be learnt: both positive, ``y`` finite."""
    return x > 0 and math.isfinite(y) and y > 0.0
