"""A bound on each endpoint's share of recent routing decisions (pure).

Prefix affinity concentrates traffic: every request of a popular prefix follows it
to the endpoint that holds it, and at light load queue-based scorers see nothing
to balance. A :class:`ShareGuard` remembers the endpoints of the last ``window``
decisions; an endpoint whose share of them exceeds the fair share among the
current candidates (``1 / len(candidates)``) plus ``slack`` is *over share*, and
prefix scorers then ignore its prefix, so the request goes where load says and the
prefix gets a second home. Bounded loads, in the spirit of consistent hashing
with bounded loads. The guard waits for ``4 * len(candidates)`` decisions before it
judges anyone; ``slack`` None turns it off.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Sequence

__all__ = ["ShareGuard"]


class ShareGuard:
    """Shares of the last ``window`` decisions; see the module docstring."""

    def __init__(self, slack: float | None, window: int = 256) -> None:
        if window < 1:
            raise ValueError("window must be >= 1")
        self.slack = slack
        self._recent: deque[str] = deque(maxlen=window)
        self._counts: Counter[str] = Counter()

    def record(self, endpoint: str) -> None:
        """``endpoint`` received a request."""
        recent = self._recent
        if len(recent) == recent.maxlen:
            oldest = recent[0]
            self._counts[oldest] -= 1
            if not self._counts[oldest]:
                del self._counts[oldest]
        recent.append(endpoint)
        self._counts[endpoint] += 1

    def share(self, endpoint: str) -> float:
        """``endpoint``'s share of the remembered decisions (0 when there are none)."""
        return self._counts[endpoint] / len(self._recent) if self._recent else 0.0

    def over(self, names: Sequence[str]) -> list[bool]:
        """Per name, whether it is over its fair share among ``names`` plus the slack."""
        if self.slack is None or not names or len(self._recent) < 4 * len(names):
            return [False] * len(names)
        limit = (1 / len(names) + self.slack) * len(self._recent)
        return [self._counts[name] > limit for name in names]
