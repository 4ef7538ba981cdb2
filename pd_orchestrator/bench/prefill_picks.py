"""How a strategy's system picks the prefiller of a P/D request.

* :attr:`PrefillPick.PROFILE` -- the gateway's prefill routing profile's first pick
  (this project's own flow, and every strategy whose peer has no rule of its own
  here yet).
* :attr:`PrefillPick.DYNAMO_KV` -- NVIDIA Dynamo's KV-aware prefill router. Its
  cost per prefill worker, lowest wins (docs ``router/routing-concepts.md`` and
  ``router/disaggregated-serving.md``; ``lib/kv-router/src/scheduling/selector/
  default.rs``)::

      cost = prefill_load_scale * max(0, active_prefill_blocks + request_blocks
                                          - overlap_credit)
      overlap_credit = overlap_score_credit * device_overlap_blocks

  at Dynamo's defaults: ``prefill_load_scale`` 1.0, ``overlap_score_credit`` 1.0,
  credit decay 0 (so no decay), host and disk tiers absent here; the prefill router
  does not track decode blocks (``track_active_blocks=false``), so that term is 0.
  ``active_prefill_blocks``: the prompt blocks routed to the worker that have not
  had their first token yet (Dynamo keeps a prompt charged until then). At
  temperature 0 Dynamo breaks ties at random; here the first in the profile's order
  wins, so a run stays reproducible.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["PrefillLoad", "PrefillPick", "blocks_of", "dynamo_pick", "dynamo_prefill_cost"]


class PrefillPick(enum.Enum):
    """Which system's rule picks the prefiller (module docstring)."""

    PROFILE = "profile"
    DYNAMO_KV = "dynamo-kv"


@dataclass(frozen=True, slots=True)
class PrefillLoad:
    """What Dynamo's router knows of one prefill worker for one request: ``active_tokens``,
    prompt tokens routed there without a first token yet; ``cached_tokens``, the
    request's leading tokens its device prefix cache holds."""

    name: str
    active_tokens: int
    cached_tokens: int


def blocks_of(tokens: int, block_size: int) -> int:
    """Blocks that ``tokens`` tokens fill (a partial block counts)."""
    return -(-max(0, tokens) // block_size)


def dynamo_prefill_cost(load: PrefillLoad, prompt_tokens: int, block_size: int) -> int:
    """Dynamo's prefill cost of ``load``'s worker for a ``prompt_tokens`` prompt, in
    blocks (module docstring; scale and credit 1.0)."""
    raw = blocks_of(load.active_tokens, block_size) + blocks_of(prompt_tokens, block_size)
    return max(0, raw - load.cached_tokens // block_size)


def dynamo_pick(loads: Sequence[PrefillLoad], prompt_tokens: int, block_size: int) -> str:
    """The worker Dynamo's prefill router picks among ``loads`` (non-empty): the lowest
    cost, the first of equals."""
    if not loads:
        raise ValueError("no prefill worker to pick from")
    best = min(
        range(len(loads)),
        key=lambda i: (dynamo_prefill_cost(loads[i], prompt_tokens, block_size), i),
    )
    return loads[best].name
