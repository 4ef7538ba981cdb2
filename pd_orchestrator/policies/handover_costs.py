"""The P/D hand-over's cost, learnt as a fixed part and a per-token part.

``H(L) = fixed + L * per_token``: seconds from the prefill leg's answer until the
decoder's first token of an ``L``-token prompt (the KV's transfer and the
orchestration around it: a published NIXL hand-over took ~200 ms p50, of which the
transfer was ~30 ms). Learnt as one rate, a fixed cost would make short prompts look
cheap to send and long ones dear; so the samples are kept per prompt-length octave
(``L`` in ``[2^(k-1), 2^k)``), each octave a bounded moving mean of its samples and
of their lengths, and ``(fixed, per_token)`` is the non-negative least-squares line
through the octaves (with one octave only, the per-token part stays and the fixed
part takes the rest, or, when the rest is negative, no fixed part and the per-token
part all of it).

Robust: a sample is first clipped into ``[v / k, k * v]`` of its octave's mean ``v``
(``k`` = :data:`MAX_STEP`), then moves it by ``alpha`` of the way; an octave starts
from the current line's estimate, so no one sample, however far off, moves an
estimate by more than ``alpha * (k - 1)`` of it. Pure: no clock, no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pd_orchestrator.model.measured import nonnegative_least_squares

__all__ = ["MAX_STEP", "HandoverCosts"]

MAX_STEP = 1.5
"""The most one sample may multiply or divide its octave's mean by before averaging."""


@dataclass(slots=True)
class HandoverCosts:
    """``fixed`` seconds and ``per_token`` seconds a prompt token (module docstring);
    ``octaves``: per octave, the moving means ``[tokens, seconds]`` of its samples."""

    fixed: float = 0.0
    per_token: float = 0.0
    octaves: dict[int, list[float]] = field(default_factory=dict)

    def seconds(self, tokens: float) -> float:
        """``H(tokens)``."""
        return self.fixed + tokens * self.per_token

    def learn(self, tokens: int, seconds: float, alpha: float) -> None:
        """Take one hand-over of a ``tokens``-token prompt that took ``seconds``
        (ignored unless both are positive and finite)."""
        if tokens <= 0 or not (math.isfinite(seconds) and seconds > 0.0):
            return
        octave = self.octaves.get(tokens.bit_length())
        if octave is None:
            octave = self.octaves[tokens.bit_length()] = [float(tokens), self.seconds(tokens)]
        mean = octave[1]
        if mean > 0.0:
            seconds = min(max(seconds, mean / MAX_STEP), mean * MAX_STEP)
        octave[0] += alpha * (tokens - octave[0])
        octave[1] += alpha * (seconds - mean)
        self._refit()

    def _refit(self) -> None:
        means = list(self.octaves.values())
        if len(means) == 1:
            tokens, seconds = means[0]
            self.fixed = max(seconds - tokens * self.per_token, 0.0)
            if self.fixed == 0.0:
                self.per_token = seconds / tokens
            return
        rows = [[1.0, tokens] for tokens, _ in means]
        self.fixed, self.per_token = nonnegative_least_squares(rows, [s for _, s in means])
