"""What the gateways in front of one fleet tell each other: their load reports.

With several gateway processes (``serve --workers N``, replicas behind one Service),
each sees only the requests it relays: ~1/N of what its decoders hold. Each publishes
a :class:`LoadReport` every ``shared_state.interval`` (the requests it has in flight
and the prompt tokens it has queued per endpoint; the uncached prefill tokens each
``goodput`` policy kept per decoder, decayed to the moment of the report) and adds
what the others last published (:class:`PeerReports`) to its own counts. A report
older than ``ttl`` is dropped: a gateway that stopped counts nothing.

Reports arrive from the network: :func:`decode` parses one defensively and drops
anything else (a foreign message, a report too large, a negative count). Pure: no
I/O; the clock is the caller's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import orjson

from pd_orchestrator.model.records import record

__all__ = ["LoadReport", "PeerReports", "Totals", "decode", "encode"]

MAX_ENTRIES = 4096
"""The most endpoints (and policy-decoder pairs) one report may carry."""

MAX_PEERS = 256
"""The most other gateways remembered at once (a report from one more is dropped)."""


@record
class LoadReport:
    """One gateway's load: ``endpoints`` maps an endpoint's name to its requests in
    flight and prompt tokens queued (before their first answer) from this gateway;
    ``kept`` maps a ``goodput`` policy's name to the uncached prefill tokens it kept
    per decoder (its duty cycle, decayed to the report's moment). Zero entries are
    left out."""

    gateway: str
    endpoints: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    kept: Mapping[str, Mapping[str, float]] = field(default_factory=dict)


@record
class Totals:
    """What the other gateways hold together: per endpoint, requests in flight and
    queued prompt tokens; per ``goodput`` policy and decoder, kept prefill tokens."""

    endpoints: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    kept: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    peers: int = 0


def encode(report: LoadReport) -> bytes:
    """``report`` as the bytes :func:`decode` reads back."""
    return orjson.dumps(
        {
            "gateway": report.gateway,
            "endpoints": {name: list(counts) for name, counts in report.endpoints.items()},
            "kept": report.kept,
        }
    )


def decode(data: bytes) -> LoadReport | None:
    """The report in ``data``, or None when it is not one: not JSON, a field of the
    wrong type, a negative or non-finite count, more than :data:`MAX_ENTRIES`
    entries."""
    try:
        document = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(document, dict):
        return None
    gateway, endpoints, kept = (document.get(k) for k in ("gateway", "endpoints", "kept"))
    if not isinstance(gateway, str) or not 0 < len(gateway) <= 128:
        return None
    counts = _counts(endpoints)
    tokens = _kept(kept)
    if counts is None or tokens is None:
        return None
    return LoadReport(gateway, counts, tokens)


def _counts(value: object) -> dict[str, tuple[int, int]] | None:
    if not isinstance(value, dict) or len(value) > MAX_ENTRIES:
        return None
    out: dict[str, tuple[int, int]] = {}
    for name, pair in value.items():
        if not isinstance(pair, list) or len(pair) != 2:
            return None
        in_flight, backlog = pair
        if not (_count(in_flight) and _count(backlog)):
            return None
        out[name] = (in_flight, backlog)
    return out


def _kept(value: object) -> dict[str, dict[str, float]] | None:
    if not isinstance(value, dict):
        return None
    out: dict[str, dict[str, float]] = {}
    entries = 0
    for policy, decoders in value.items():
        if not isinstance(decoders, dict):
            return None
        entries += len(decoders)
        if entries > MAX_ENTRIES:
            return None
        per: dict[str, float] = {}
        for decoder, tokens in decoders.items():
            if not isinstance(tokens, int | float) or isinstance(tokens, bool):
                return None
            if not math.isfinite(tokens) or tokens < 0:
                return None
            per[decoder] = float(tokens)
        out[policy] = per
    return out


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


@dataclass(slots=True)
class PeerReports:
    """The last report of each other gateway (``own``: this gateway's id, whose
    reports, echoed back by the server, are ignored), dropped ``ttl`` seconds after
    it arrived."""

    own: str
    ttl: float
    _last: dict[str, tuple[float, LoadReport]] = field(default_factory=dict)

    def receive(self, report: LoadReport, now: float) -> None:
        """Keep ``report`` as its gateway's latest (arrived at ``now``)."""
        if report.gateway == self.own:
            return
        if report.gateway not in self._last and len(self._last) >= MAX_PEERS:
            self.expire(now)
            if len(self._last) >= MAX_PEERS:
                return
        self._last[report.gateway] = (now, report)

    def expire(self, now: float) -> None:
        """Drop the reports older than ``ttl``."""
        stale = [g for g, (at, _) in self._last.items() if now - at > self.ttl]
        for gateway in stale:
            del self._last[gateway]

    def clear(self) -> None:
        """Forget every report (the server is unreachable: each gateway alone)."""
        self._last.clear()

    def totals(self, now: float) -> Totals:
        """What the other gateways hold together now (stale reports dropped first)."""
        self.expire(now)
        endpoints: dict[str, tuple[int, int]] = {}
        kept: dict[str, dict[str, float]] = {}
        for _, report in self._last.values():
            for name, (in_flight, backlog) in report.endpoints.items():
                was = endpoints.get(name, (0, 0))
                endpoints[name] = (was[0] + in_flight, was[1] + backlog)
            for policy, decoders in report.kept.items():
                mine = kept.setdefault(policy, {})
                for decoder, tokens in decoders.items():
                    mine[decoder] = mine.get(decoder, 0.0) + tokens
        return Totals(endpoints, kept, len(self._last))
