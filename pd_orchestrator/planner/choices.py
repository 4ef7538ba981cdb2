"""The choices a request makes after its plan (pure): every one is a function of the
plan plus what failed in this request, so the planner owns them all.

* :func:`next_decoder`: where a request goes after a decoder failed it (a recovery, a
  retry before the first byte, a hand-back's next decoder);
* :func:`next_prefiller`: the prefiller of the next prefill attempt;
* :func:`pick_fallback`: the decoder that takes a request every asked decoder
  rejected (ask-all);
* :func:`sidecar_order`: the order in which a sidecar request's named prefillers are
  tried (spread over them, reproducibly per request id).

What they read of the fleet's state is :class:`FleetView`: whether an endpoint is in
routing (healthy, not ejected) and whether it is out only because a leg broke on it.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Collection, Sequence
from typing import Protocol

from pd_orchestrator.config.settings import AskAllFallbackConfig
from pd_orchestrator.model.endpoints import Endpoint
from pd_orchestrator.model.load import Candidate

__all__ = [
    "FleetView",
    "next_decoder",
    "next_prefiller",
    "pick_fallback",
    "sidecar_order",
    "suspects",
]


class FleetView(Protocol):
    """What the choices read of the fleet's state."""

    def is_healthy(self, name: str) -> bool:
        """In routing: healthy and not ejected."""
        ...

    def is_suspect(self, name: str) -> bool:
        """Out of routing only because a leg broke on it (not failed checks, not ejected)."""
        ...


def next_decoder(
    decoders: Sequence[Endpoint],
    spares: Sequence[Endpoint],
    failed: Collection[str],
    fleet: FleetView,
) -> Endpoint | None:
    """The best of ``decoders`` (the plan's, best first) not seen failing in this request
    and in routing, else the best not seen failing, else the best of ``spares`` (every
    decoder ranked with health set aside) not seen failing and only a suspect; None
    when none is left."""
    usable = [d for d in decoders if d.name not in failed]
    for decoder in usable:
        if fleet.is_healthy(decoder.name):
            return decoder
    if usable:
        return usable[0]
    left = suspects(spares, failed, fleet)
    return left[0] if left else None


def suspects(
    spares: Sequence[Endpoint], failed: Collection[str], fleet: FleetView
) -> tuple[Endpoint, ...]:
    """The ``spares`` out of routing only because a leg broke on them, not seen failing
    in this request, best first: where a request goes when its plan has no decoder left."""
    return tuple(d for d in spares if d.name not in failed and fleet.is_suspect(d.name))


def next_prefiller(
    prefillers: Sequence[Endpoint],
    tried: Sequence[str],
    failed: Collection[str],
    fleet: FleetView,
) -> Endpoint | None:
    """The best of ``prefillers`` not seen failing in this request and in routing, else
    the best not seen failing, else the best not yet tried, else the next in turn
    (None: there are no prefillers)."""
    fresh = [p for p in prefillers if p.name not in failed]
    for prefiller in fresh:
        if fleet.is_healthy(prefiller.name):
            return prefiller
    untried = [p for p in prefillers if p.name not in tried]
    if fresh or untried:
        return (fresh or untried)[0]
    if not prefillers:
        return None
    return prefillers[len(tried) % len(prefillers)]


def sidecar_order(named: tuple[Endpoint, ...], request_id: str) -> tuple[Endpoint, ...]:
    """``named`` rotated by the request id's hash: requests spread over the prefillers a
    sidecar header names, and one request always tries them in the same order."""
    if len(named) < 2:
        return named
    turn = zlib.crc32(request_id.encode()) % len(named)
    return named[turn:] + named[:turn]


def _fallback_key(candidate: Candidate, config: AskAllFallbackConfig) -> tuple[float, float]:
    load = candidate.load
    if config.pick == "most-free-kv":
        return (load.kv_usage if load is not None else math.inf, candidate.in_flight)
    if config.pick == "hardware-weight":
        weight = config.hardware_weights.get(candidate.endpoint.hardware, 1.0)
        return (-weight, candidate.in_flight)
    depth = load.queue_depth if load is not None else 0
    return (max(depth, candidate.in_flight), candidate.in_flight)


def pick_fallback(
    asked: Sequence[Endpoint],
    candidates: Sequence[Candidate],
    config: AskAllFallbackConfig,
    ordinal: int = 0,
    prefer: Sequence[str] = (),
) -> Endpoint:
    """The decoder that takes a request every asked decoder rejected (pure).

    The best by ``config.pick``, unless one of ``prefer`` (decoders that hold part of
    the prompt, most first: the decode leg then pulls less KV) is as good, or, for
    ``least-loaded``, has at most ``config.holder_slack`` more requests queued: then
    the first of them. Otherwise equals take turns: in the fleet's order (the order of
    ``candidates``), the ``ordinal``-th of them (modulo their number), so requests
    that tie, one after another, spread over the tied decoders. Candidates not asked
    are ignored; an asked decoder without a candidate entry ranks last.
    """
    position = {c.endpoint.name: i for i, c in enumerate(candidates)}
    by_name = {c.endpoint.name: c for c in candidates}
    keyed = sorted(
        (
            (0, _fallback_key(by_name[e.name], config)) if e.name in by_name else (1, (0.0, 0.0)),
            position.get(e.name, len(position) + order),
            e,
        )
        for order, e in enumerate(asked)
    )
    best = keyed[0][0]
    slack = config.holder_slack if config.pick == "least-loaded" else 0.0
    near = {e.name for key, _, e in keyed if key[0] == best[0] and key[1][0] <= best[1][0] + slack}
    for name in prefer:
        if name in near:
            return next(endpoint for _, _, endpoint in keyed if endpoint.name == name)
    tied = [endpoint for key, _, endpoint in keyed if key == best]
    return tied[ordinal % len(tied)]
