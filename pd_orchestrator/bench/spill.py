"""The bench's plain spill rule: like for like on fleets whose prefill pool spills.

A prefiller whose pool spills (``--prefill-role spill``) may also serve a request
whole. ``goodput`` decides that with its cost model (its own rule, part of the
product under test); the other strategies' systems have no such rule, so on a
spilling fleet the bench gives every one of them the same plain rule, in the
virtual fleet's flow (:meth:`~pd_orchestrator.bench.virtual.VirtualFleet.spilled`):

* the request's decoder is **queued** (its latest scraped waiting queue is not
  empty) or **crowded** (its latest scraped KV usage is at least
  :data:`CROWDED_KV_USAGE`);
* then it is served whole on the least-loaded compatible spilling prefiller that is
  itself neither queued nor crowded: the fewest prompt tokens routed there without a
  first token yet, then the fewest requests in flight, then the first in the prefill
  profile's order;
* otherwise the strategy routes it as on a split fleet.

The rule reads only what any peer router has: scraped ``num_requests_waiting`` and
KV usage, and its own in-flight counts.
"""

from __future__ import annotations

from collections.abc import Sequence

from pd_orchestrator.model.records import record

__all__ = ["CROWDED_KV_USAGE", "SpillLoad", "plain_spill", "strained"]

CROWDED_KV_USAGE = 0.9
"""A KV cache this full is crowded: the next streams' growth preempts."""


@record
class SpillLoad:
    """What a router knows of one instance: ``waiting`` and ``kv_usage`` from its
    latest scrape (none yet: 0 and 0.0), ``active_tokens`` the prompt tokens routed
    there without a first token yet, ``in_flight`` its requests in flight."""

    name: str
    waiting: int = 0
    kv_usage: float = 0.0
    active_tokens: int = 0
    in_flight: int = 0


def strained(load: SpillLoad) -> str | None:
    """``queued`` or ``crowded`` (module docstring), or None when it is neither."""
    if load.waiting > 0:
        return "queued"
    if load.kv_usage >= CROWDED_KV_USAGE:
        return "crowded"
    return None


def plain_spill(decoder: SpillLoad, spills: Sequence[SpillLoad]) -> tuple[str, str] | None:
    """The spilling prefiller among ``spills`` (the prefill profile's order) that serves
    the request whole, and why (``queued`` or ``crowded``, the decoder's state); None
    when the decoder is neither or every spilling prefiller is strained itself."""
    why = strained(decoder)
    if why is None:
        return None
    free = [i for i, load in enumerate(spills) if strained(load) is None]
    if not free:
        return None
    best = min(free, key=lambda i: (spills[i].active_tokens, spills[i].in_flight, i))
    return spills[best].name, why
