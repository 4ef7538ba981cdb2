"""Mutable fleet state: health and in-flight requests per endpoint.

Health has two sources. Active: health checks, and connections that cannot be made
(``unhealthy_after`` failures in a row mark an endpoint unhealthy, one success marks
it healthy); a health check that got no answer in time does not count against an
endpoint that answered real traffic since the previous check (a busy server answers
its health checks late, and what it does for requests decides). Passive: the
outcome of every leg of real traffic, counted by outlier detection
(:mod:`~pd_orchestrator.fleet.outliers`), which ejects an endpoint that keeps
failing for a while. An endpoint is in routing (``healthy`` in a snapshot)
when it is healthy and not ejected; when none of a role is, the routing's
``healthy`` filter routes to all of them anyway (panic routing). One that a broken
leg took out (:meth:`FleetState.mark_unhealthy`) is a *suspect* until it answers
or passes a check: a request with no other decoder left may still try it.

The planner never sees this object, only immutable snapshots
(:meth:`FleetState.snapshot`, or the routing candidates kept current from
:meth:`FleetState.take_changed`), so its decisions are pure functions of a moment.
Everything a leg reports costs O(1), but for a prompt's pending block keys (held
once when it is sent and given back once, each O(its blocks): only requests the
planner gave keys, see :attr:`FleetState.pending`).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from collections.abc import Set as AbstractSet
from contextlib import contextmanager

from connectors import PeerUpdate
from pd_orchestrator.config.settings import OutlierConfig
from pd_orchestrator.fleet.outliers import Outlier, failure_kind, may_eject
from pd_orchestrator.model.endpoints import Endpoint, EndpointStatus, Role
from pd_orchestrator.prefix.pending import PendingBlocks
from pd_orchestrator.upstream.errors import UpstreamError

__all__ = ["FleetState"]

logger = logging.getLogger("pd_orchestrator.fleet")
OnEject = Callable[[str, str], None]
"""Told of each ejection: endpoint name and reason."""
_NOTHING: frozenset[str] = frozenset()
_NONE = (0, 0)
"""No other gateway's requests at an endpoint: none in flight, no tokens queued."""


class FleetState:
    """Health (active checks plus passive outlier detection) and in-flight counts.

    ``outlier``: the ejection settings (default: :class:`OutlierConfig`'s);
    ``clock``: for ejection times; ``on_eject``: told of each ejection (metrics);
    ``max_named``: how many endpoints that are not configured (a sidecar header's)
    are tracked at most (see :meth:`_track`).
    """

    def __init__(
        self,
        endpoints: Iterable[Endpoint],
        unhealthy_after: int = 2,
        *,
        outlier: OutlierConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_eject: OnEject | None = None,
        max_named: int = 256,
    ) -> None:
        self._endpoints = {e.name: e for e in endpoints}
        self._healthy = dict.fromkeys(self._endpoints, True)
        self._failures = dict.fromkeys(self._endpoints, 0)
        self._in_flight = dict.fromkeys(self._endpoints, 0)
        self._backlog = dict.fromkeys(self._endpoints, 0)
        self._others: Mapping[str, tuple[int, int]] = {}
        self._outliers = {name: Outlier() for name in self._endpoints}
        self._ejected: dict[str, Outlier] = {}
        self._answered: set[str] = set()
        self._suspects: set[str] = set()
        self.unhealthy_after = unhealthy_after
        self.outlier = outlier or OutlierConfig()
        self.clock = clock
        self.on_eject = on_eject
        self.checked_once = False
        self._learned: dict[str, PeerUpdate] = {}
        self._named: OrderedDict[str, None] = OrderedDict()
        self.max_named = max_named
        self.pending: PendingBlocks[int] = PendingBlocks()
        """The block keys of prompts in flight per endpoint, before their first answer
        (what :meth:`enter` is given)."""
        self._changed: set[str] = set()
        self._all_changed = True

    def endpoints(self, role: Role | None = None) -> list[Endpoint]:
        """Endpoints able to play ``role`` (``both`` endpoints count for either)."""
        return [e for e in self._endpoints.values() if _plays(e, role)]

    def get(self, name: str) -> Endpoint:
        return self._endpoints[name]

    def snapshot(self, role: Role | None = None) -> tuple[EndpointStatus, ...]:
        """Immutable statuses of the endpoints with ``role`` (all when None); ``healthy``
        means in routing: healthy and not ejected. In-flight counts and backlogs are
        this gateway's plus the other gateways' (:meth:`share`)."""
        return tuple([self.status_of(e.name) for e in self.endpoints(role)])

    def status_of(self, name: str) -> EndpointStatus:
        """One configured endpoint's status as :meth:`snapshot` gives it."""
        more, queued = self._others.get(name, _NONE)
        return EndpointStatus(
            self._endpoints[name],
            self._healthy[name] and name not in self._ejected,
            self._in_flight[name] + more,
            self._backlog[name] + queued,
        )

    def counted(self, name: str) -> int:
        """Requests in flight on ``name`` by this gateway's and the other gateways'
        counts, as :meth:`status_of` gives them (0: an endpoint not tracked)."""
        return self._in_flight.get(name, 0) + self._others.get(name, _NONE)[0]

    def take_changed(self) -> AbstractSet[str] | None:
        """The endpoints whose :meth:`status_of` may have changed since the last call
        (None: any of them may have), and start counting afresh. One reader keeps a
        view current with it (:meth:`~pd_orchestrator.fleet.scraper.LoadScraper.current`);
        the set holds at most every endpoint ever tracked."""
        if self._all_changed:
            self._all_changed = False
            self._changed.clear()
            return None
        changed = self._changed
        if not changed:
            return _NOTHING
        self._changed = set()
        return changed

    def own_load(self) -> dict[str, tuple[int, int]]:
        """This gateway's requests in flight and queued prompt tokens per configured
        endpoint, the endpoints with neither left out (what it reports to the others)."""
        backlog = self._backlog
        return {
            name: (count, backlog[name])
            for name, count in self._in_flight.items()
            if (count or backlog[name]) and name in self._endpoints
        }

    def share(self, others: Mapping[str, tuple[int, int]]) -> None:
        """What the other gateways have in flight and queued per endpoint (empty: this
        gateway counts its own alone)."""
        self._others = others
        self._all_changed = True

    def inherit(self, previous: FleetState) -> None:
        """Keep the health and ejection state of endpoints that ``previous`` had under
        the same name and URL."""
        for name, endpoint in self._endpoints.items():
            old = previous._endpoints.get(name)
            if old is not None and old.url == endpoint.url:
                self._healthy[name] = previous._healthy[name]
                self._failures[name] = previous._failures[name]
                self._outliers[name] = outlier = previous._outliers[name]
                if outlier.ejected:
                    self._ejected[name] = outlier
        self.checked_once = previous.checked_once
        self._all_changed = True

    def status(self, name: str) -> EndpointStatus:
        """A snapshot of one configured endpoint, with this gateway's own counts only
        (:meth:`status_of` adds the other gateways')."""
        endpoint = self._endpoints[name]
        return EndpointStatus(
            endpoint, self.is_healthy(name), self._in_flight[name], self._backlog[name]
        )

    def is_healthy(self, name: str) -> bool:
        """In routing: healthy (active checks) and not ejected (passive)."""
        return self._healthy.get(name, True) and name not in self._ejected

    def is_suspect(self, name: str) -> bool:
        """Out of routing only because a leg broke on it (:meth:`mark_unhealthy`) since
        it last answered or passed a check -- not for failed checks or connections, not
        ejected: a recovery with no healthy decoder left may still try it."""
        return name in self._suspects and name not in self._ejected

    def outlier_of(self, name: str) -> Outlier | None:
        """The passive record of ``name`` (None: never seen)."""
        return self._outliers.get(name)

    def _track(self, name: str) -> None:
        """Track an endpoint that is not configured (a sidecar header's), most recently
        used last; past ``max_named`` of them the least recently used one with nothing
        in flight is forgotten (its health, counters and what was learned of it)."""
        if name in self._endpoints:
            return
        named = self._named
        if name in named:
            named.move_to_end(name)
            return
        named[name] = None
        self._healthy[name] = True
        self._failures[name] = 0
        self._in_flight[name] = 0
        self._backlog[name] = 0
        self._outliers[name] = Outlier()
        if len(named) > self.max_named:
            self._forget_one_idle(name)

    def _forget_one_idle(self, keep: str) -> None:
        for old in self._named:
            if old != keep and not self._in_flight[old]:
                del self._named[old]
                tables = (self._healthy, self._failures, self._in_flight, self._backlog)
                for table in (*tables, self._outliers):
                    del table[old]
                for keyed in (self._ejected, self._learned):
                    keyed.pop(old, None)
                self._answered.discard(old)
                self._suspects.discard(old)
                return

    @property
    def named_count(self) -> int:
        """How many endpoints that are not configured are tracked."""
        return len(self._named)

    # -- active health -------------------------------------------------------------------
    def record_check(self, name: str, healthy: bool, *, late: bool = False) -> None:
        """One active health check of ``name``: passed, or failed (``late``: no answer
        in time, which does not count if real traffic was answered since the last one)."""
        answered = name in self._answered
        self._answered.discard(name)
        if healthy:
            self._reachable(name)
            if self._ejected:
                self._maybe_return(name)
        elif not (late and answered):
            self.record_failure(name)

    def record_failure(self, name: str) -> None:
        """One failed check or connection; enough in a row mark the endpoint unhealthy."""
        self._track(name)
        self._suspects.discard(name)
        self._failures[name] += 1
        if self._failures[name] >= self.unhealthy_after:
            self._healthy[name] = False
            self._changed.add(name)

    def mark_unhealthy(self, name: str) -> None:
        """A leg broke on ``name`` mid-answer: out of routing until it answers or passes a
        check again (a suspect: see :meth:`is_suspect`)."""
        self._track(name)
        self._failures[name] = max(self._failures[name], self.unhealthy_after)
        self._healthy[name] = False
        self._suspects.add(name)
        self._changed.add(name)

    def _reachable(self, name: str) -> None:
        """``name`` answers: healthy, its run of failed checks ends."""
        self._track(name)
        self._failures[name] = 0
        if not self._healthy[name]:
            self._healthy[name] = True
            self._changed.add(name)
        self._suspects.discard(name)

    # -- real traffic (passive) ------------------------------------------------------------
    def record_accepted(self, name: str) -> None:
        """A leg of real traffic began (a stream's status and headers came): healthy, as
        for :meth:`record_success`, but outlier detection waits for how the answer ends."""
        self._reachable(name)
        self._answered.add(name)

    def record_success(self, name: str) -> None:
        """A leg of real traffic was answered (a stream read to its end): healthy, and its
        runs of failures end."""
        self.record_accepted(name)
        self._outliers[name].answered()
        if self._ejected:
            self._maybe_return(name)

    def record_error(self, name: str, exc: UpstreamError) -> None:
        """A leg of real traffic failed with ``exc``: a connection that could not be
        made counts against active health too; outlier detection counts the rest and
        may eject the endpoint. The gateway's own failure counts for nothing."""
        if exc.gateways_own:
            return
        self._track(name)
        if exc.connection_failed:
            self.record_failure(name)
        kind = failure_kind(exc)
        outlier = self._outliers[name]
        if kind is None:
            outlier.answered()
        elif outlier.failed(kind, self.outlier, pending=self._in_flight[name]):
            self._eject(name, outlier, kind)

    def _eject(self, name: str, outlier: Outlier, reason: str) -> None:
        endpoint = self._endpoints.get(name)
        if endpoint is None or not self._can_spare(endpoint):
            return
        seconds = outlier.eject(reason, self.clock(), self.outlier)
        self._ejected[name] = outlier
        self._changed.add(name)
        logger.warning("%s ejected for %.0f s (%s)", name, seconds, reason)
        if self.on_eject is not None:
            self.on_eject(name, reason)

    def _can_spare(self, endpoint: Endpoint) -> bool:
        """Whether every role ``endpoint`` plays can do without it (O(fleet), run only
        when a counter reaches its threshold)."""
        roles = [r for r in (Role.DECODE, Role.PREFILL) if _plays(endpoint, r)]
        for role in roles:
            members = self.endpoints(role)
            ejected = sum(1 for e in members if e.name in self._ejected)
            in_routing = sum(
                1 for e in members if e.name != endpoint.name and self.is_healthy(e.name)
            )
            if not may_eject(self.outlier, len(members), ejected, in_routing):
                return False
        return True

    def _maybe_return(self, name: str) -> None:
        outlier = self._ejected.get(name)
        now = self.clock()
        if outlier is not None and outlier.may_return(now):
            outlier.restore(now)
            del self._ejected[name]
            self._changed.add(name)
            logger.warning("%s back in routing after its ejection", name)

    def enter(self, name: str, backlog: int = 0, blocks: Sequence[int] = ()) -> None:
        """One more request in flight on ``name`` (pair with :meth:`leave`), with
        ``backlog`` prompt tokens to prefill before its first answer and the prompt's
        block keys ``blocks`` pending there until then (:attr:`pending`; pair both
        with :meth:`answered`)."""
        if name not in self._in_flight:
            self._track(name)
        self._in_flight[name] += 1
        self._backlog[name] += backlog
        self._changed.add(name)
        if blocks:
            self.pending.hold(name, blocks)

    def answered(self, name: str, backlog: int, blocks: Sequence[int] = ()) -> None:
        """A request on ``name`` had its first answer (or ended): its ``backlog`` is
        out of the endpoint's, its ``blocks`` no longer pending."""
        if name in self._backlog:
            self._backlog[name] -= backlog
            self._changed.add(name)
        if blocks:
            self.pending.release(name, blocks)

    def leave(self, name: str, backlog: int = 0, blocks: Sequence[int] = ()) -> None:
        """One request in flight on ``name`` ended, with the ``backlog`` and pending
        ``blocks`` it still held."""
        self._in_flight[name] -= 1
        self._backlog[name] -= backlog
        self._changed.add(name)
        if blocks:
            self.pending.release(name, blocks)

    @contextmanager
    def in_flight(self, name: str) -> Iterator[None]:
        """Count one request in flight on ``name`` for the duration of the block."""
        self.enter(name)
        try:
            yield
        finally:
            self.leave(name)

    def learned(self, name: str) -> PeerUpdate | None:
        """What answers and lookups taught about ``name``'s connector addresses."""
        return self._learned.get(name)

    def learn(self, name: str, update: PeerUpdate) -> None:
        self._learned[name] = update

    def forget(self, name: str) -> None:
        self._learned.pop(name, None)

    def any_decoder_healthy(self) -> bool:
        return any(self.is_healthy(e.name) for e in self.endpoints(Role.DECODE))


def _plays(endpoint: Endpoint, role: Role | None) -> bool:
    if role is None or role is Role.BOTH:
        return True
    return endpoint.role.decodes if role is Role.DECODE else endpoint.role.prefills
