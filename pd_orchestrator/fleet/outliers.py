"""Passive health: outlier detection from real traffic, as Envoy does it (pure).

Every leg's outcome is reported for its endpoint, at O(1) cost (two counters):

* an answer (any status below 500; a stream once read to its end) resets both
  counters;
* an HTTP 5xx (or an error event in a stream) adds one to ``consecutive_5xx``;
* a connection failure -- refused, broken mid-answer, timed out -- or an answer no
  vLLM would send adds one to ``consecutive_failures``.

A counter that reaches its threshold (``outlier.consecutive_5xx``,
``outlier.consecutive_failures``; 0 turns one off) asks for an ejection -- once the
run also covers every request that was in flight on the endpoint when it began.
Under concurrency answers come back out of order: a failure answered at once
overtakes the slower successes of requests sent before it, so five failures in a
row as they arrive may be five of a hundred requests in flight. A run counts only
when nothing sent before it can still break it: an endpoint that fails everything
gets there (after the requests it held), one that fails some of them does not. The fleet
(:class:`~pd_orchestrator.fleet.state.FleetState`) decides whether the role can spare
the endpoint (:func:`may_eject`) and ejects it: out of routing for
``base_ejection_time`` times the number of times it was ejected, at most
``max_ejection_time``. The counters start over at each ejection. After its time, the
endpoint comes back once it answers again (an active health check passes, or a
request -- panic routing still sends some -- succeeds). The count of ejections
decays as in newer Envoy: each ``base_ejection_time`` an endpoint stays in routing
after it came back takes one off, so an endpoint that fails now and then (a restart a
minute) is ejected for the base time each time, while one that fails again as soon as
it is back is ejected for longer and longer; one that stayed in routing for
``max_ejection_time`` starts afresh.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pd_orchestrator.config.settings import OutlierConfig
from pd_orchestrator.upstream.errors import UpstreamError, UpstreamStatusError

__all__ = ["CONSECUTIVE_5XX", "CONSECUTIVE_FAILURES", "Outlier", "failure_kind", "may_eject"]

CONSECUTIVE_5XX = "consecutive_5xx"
CONSECUTIVE_FAILURES = "consecutive_failures"


def failure_kind(exc: UpstreamError) -> str | None:
    """What ``exc`` counts as: ``CONSECUTIVE_5XX``, ``CONSECUTIVE_FAILURES``, or None
    (the endpoint answered: a 4xx is the request's fault, not the endpoint's)."""
    if not exc.endpoint_at_fault:
        return None
    return CONSECUTIVE_5XX if isinstance(exc, UpstreamStatusError) else CONSECUTIVE_FAILURES


def _decayed(ejections: int, in_routing: float, config: OutlierConfig) -> int:
    """The count of ejections after ``in_routing`` seconds back in routing: one less per
    ``base_ejection_time``, none left after ``max_ejection_time``."""
    if in_routing >= config.max_ejection_time:
        return 0
    if config.base_ejection_time <= 0.0:
        return ejections
    return max(0, ejections - int(in_routing // config.base_ejection_time))


def may_eject(config: OutlierConfig, members: int, ejected: int, in_routing: int) -> bool:
    """Whether a role of ``members`` endpoints, ``ejected`` of them out already and
    ``in_routing`` others still in (healthy, not ejected), can spare one more."""
    if in_routing < 1:
        return False  # never the last one: panic routing is for "all look unhealthy"
    allowed = max(1, math.floor(members * config.max_ejection_percent / 100.0))
    return ejected < allowed


@dataclass(slots=True)
class Outlier:
    """The passive record of one endpoint (see the module docstring)."""

    consecutive_5xx: int = 0
    consecutive_failures: int = 0
    pending_5xx: int = 0
    pending_failures: int = 0
    ejections: int = 0
    ejected_until: float | None = None
    reason: str = ""
    returned_at: float = -math.inf

    @property
    def ejected(self) -> bool:
        return self.ejected_until is not None

    def answered(self) -> None:
        """The endpoint answered a request: both runs of failures end."""
        self.consecutive_5xx = 0
        self.consecutive_failures = 0

    def failed(self, kind: str, config: OutlierConfig, pending: int = 0) -> bool:
        """Count one failure of ``kind``, with ``pending`` other requests in flight on
        the endpoint; True when its run reached the threshold and covers the
        requests that were in flight when it began."""
        if kind == CONSECUTIVE_5XX:
            if not self.consecutive_5xx:
                self.pending_5xx = pending
            self.consecutive_5xx += 1
            limit, count, covers = config.consecutive_5xx, self.consecutive_5xx, self.pending_5xx
        else:
            if not self.consecutive_failures:
                self.pending_failures = pending
            self.consecutive_failures += 1
            limit = config.consecutive_failures
            count, covers = self.consecutive_failures, self.pending_failures
        return limit > 0 and count >= max(limit, covers + 1) and not self.ejected

    def eject(self, reason: str, now: float, config: OutlierConfig) -> float:
        """Take the endpoint out of routing; returns the seconds it stays out."""
        self.ejections = _decayed(self.ejections, now - self.returned_at, config)
        self.ejections += 1
        seconds = min(config.base_ejection_time * self.ejections, config.max_ejection_time)
        self.ejected_until = now + seconds
        self.reason = reason
        self.answered()
        return seconds

    def may_return(self, now: float) -> bool:
        """Whether an ejected endpoint's time is up (it returns when it answers again)."""
        return self.ejected_until is not None and now >= self.ejected_until

    def restore(self, now: float) -> None:
        """Back in routing."""
        self.ejected_until = None
        self.returned_at = now
        self.answered()
