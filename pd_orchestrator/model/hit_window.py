"""Where an endpoint's prefix hit rate is counted from (ground floor).

A server exports its prefix cache's queried and hit prompt tokens as two counters;
a hit rate is their increase over a window. The window between two polls holds
what the server admitted in that second, and at a burst's start that is its first
few prompts: on a warm shared-prefix burst each decoder's first window held one to
three cold prompts, read 0, and the policy priced every queue there as uncached
until the next poll (several times the prefill it held). So the window reaches back,
over the polls at which the query counter moved, until it holds at least
``tokens`` queried tokens (as vLLM's own logged hit rate covers its last thousand
requests, not the last interval).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Generic, TypeVar

__all__ = ["HIT_WINDOW_STARTS", "HitWindow"]

HIT_WINDOW_STARTS = 16
"""Polls a window may reach back over (those at which the query counter moved)."""

R = TypeVar("R")


@dataclass(slots=True)
class HitWindow(Generic[R]):
    """The readings a hit rate's window may start at: the last
    :data:`HIT_WINDOW_STARTS` at which the endpoint's query counter moved, oldest
    first, each with that count. ``tokens``: the queried tokens a window reaches
    back for (0: the last reading at which the counter moved)."""

    tokens: float
    starts: deque[tuple[float, R]] = field(default_factory=lambda: deque(maxlen=HIT_WINDOW_STARTS))

    def start(self, queries: float) -> R | None:
        """The reading to count from at a query count of ``queries``: the newest held
        since which at least ``tokens`` were queried, else the oldest held since which
        the counter only grew. None: none held, nothing queried since the newest (a
        window with no queries gives no rate, as before; reaching back from one, the
        policy read an older window's rate where it remembered a later one, and lost
        a grid step on eight of fifteen warm development bursts), or a restart."""
        starts = self.starts
        if not starts or queries == starts[-1][0]:
            return None
        found: R | None = None
        for count, reading in reversed(starts):
            if count > queries:  # the server restarted after it
                break
            found = reading
            if queries - count >= self.tokens:
                break
        return found

    def moved(self, queries: float, reading: R) -> None:
        """Hold ``reading`` (at ``queries``) as a start when the counter moved since the
        newest held; a count below it (a restart) forgets the ones before."""
        starts = self.starts
        if starts and queries < starts[-1][0]:
            starts.clear()
        if not starts or queries != starts[-1][0]:
            starts.append((queries, reading))

    def restart(self, queries: float, reading: R) -> None:
        """Count from ``reading`` alone (after prompts that no client sent)."""
        self.starts.clear()
        self.starts.append((queries, reading))
