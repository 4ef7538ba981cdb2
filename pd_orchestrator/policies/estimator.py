"""Prompt length in tokens without a tokenizer round trip.

``tokens ~= chars / ratio(model)``. The ratio starts at the configured
``chars_per_token`` and, when calibrating, learns from the ``prompt_tokens`` that
upstream usage reports for prompts of known size (:meth:`PromptLengthEstimator.observe`).

The learnt ratio is a running geometric mean, bounded and robust: each observed
ratio ``chars / prompt_tokens`` is first clipped to ``[min_chars_per_token,
max_chars_per_token]``; then, with ``k`` observations so far for the model::

    log r  +=  a_k * (log observed - log r),    a_k = max(1 / (k + 2), 1 / window)

so the prior counts as one observation, the first ``window`` observations are
averaged evenly (fast convergence) and later ones form an exponential moving
average over about ``window`` requests (drift). One outlier moves the ratio by at
most a factor ``(max / min) ** a_k``. For a constant true ratio within the bounds
the error in ``log r`` is the prior's divided by ``k + 1`` while averaging, and
shrinks by ``1 - 1 / window`` per observation after. Models beyond ``max_models``
are estimated with the prior and not learnt (memory stays bounded whatever model
names clients send).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = ["PromptLengthEstimator"]


@dataclass(slots=True)
class _Learnt:
    log_ratio: float
    count: int = 0


@dataclass(slots=True)
class PromptLengthEstimator:
    """See the module docstring. Pure: no I/O, deterministic in its inputs."""

    chars_per_token: float = 4.0
    calibrate: bool = True
    min_chars_per_token: float = 1.0
    max_chars_per_token: float = 16.0
    window: int = 200
    max_models: int = 1024
    _models: dict[str, _Learnt] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        low, high = self.min_chars_per_token, self.max_chars_per_token
        if not 0.0 < low <= self.chars_per_token <= high or not math.isfinite(high):
            raise ValueError(
                f"need 0 < min_chars_per_token <= chars_per_token <= max_chars_per_token, "
                f"got {low}, {self.chars_per_token}, {high}"
            )
        if self.window < 1 or self.max_models < 0:
            raise ValueError("window must be >= 1 and max_models >= 0")

    def ratio(self, model: str) -> float:
        """Characters per token for ``model`` (learnt, or the prior)."""
        learnt = self._models.get(model)
        return self.chars_per_token if learnt is None else math.exp(learnt.log_ratio)

    def estimate(self, model: str, chars: int) -> int:
        """Tokens of a ``chars``-character prompt of ``model`` (0 for 0, else >= 1)."""
        if chars <= 0:
            return 0
        return max(1, round(chars / self.ratio(model)))

    def observe(self, model: str, chars: int, prompt_tokens: int) -> None:
        """Learn from a prompt of ``chars`` characters that upstream counted as
        ``prompt_tokens`` tokens. Ignored when not calibrating or either is <= 0."""
        if not self.calibrate or chars <= 0 or prompt_tokens <= 0:
            return
        learnt = self._models.get(model)
        if learnt is None:
            if len(self._models) >= self.max_models:
                return
            learnt = self._models[model] = _Learnt(math.log(self.chars_per_token))
        low, high = self.min_chars_per_token, self.max_chars_per_token
        observed = min(high, max(low, chars / prompt_tokens))
        rate = max(1.0 / (learnt.count + 2), 1.0 / self.window)
        learnt.log_ratio += rate * (math.log(observed) - learnt.log_ratio)
        learnt.count += 1
