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
* :attr:`PrefillPick.LLM_D` -- llm-d's prefill profile in its shipped P/D sample
  (``deploy/config/pd-epp-config.yaml`` at v0.10.0): ``prefix-cache-scorer`` weight 2
  plus ``queue-scorer`` weight 1, ``max-score-picker``. The prefix score is the
  matched share of the prompt's blocks (llm-d estimates it from its own index of
  routed prompts; here the prefiller's cache stands in); the queue score is the
  waiting queue min-max normalised, the shortest 1 and the longest 0 (all equal: 1),
  from the latest scraped reading (none: 0 waiting). Ties: the first (llm-d shuffles).
* :attr:`PrefillPick.CACHE_AWARE` -- vllm-router's P/D mode at its defaults
  (``--prefill-policy`` falls back to ``--policy``, default ``cache_aware``;
  ``src/policies/cache_aware.rs``): when the loads (the router's in-flight counts)
  are imbalanced -- ``max - min > 64`` and ``max > 1.5 x min`` -- the least loaded;
  otherwise the best prefix match if its match rate exceeds 0.3, else the worker
  whose prefix tree is smallest. The tree holds the text routed to a worker: here
  the match rate is the prefiller's cached share of the prompt, and the tree's size
  the prompt tokens routed there so far (the tree's 120 s eviction not modelled).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

from pd_orchestrator.model.records import record

__all__ = [
    "PrefillLoad",
    "PrefillPick",
    "blocks_of",
    "cache_aware_pick",
    "dynamo_pick",
    "dynamo_prefill_cost",
    "llm_d_pick",
]

CACHE_AWARE_ABS_IMBALANCE = 64
CACHE_AWARE_REL_IMBALANCE = 1.5
CACHE_AWARE_MATCH = 0.3
LLM_D_PREFIX_WEIGHT = 2.0
LLM_D_QUEUE_WEIGHT = 1.0


class PrefillPick(enum.Enum):
    """Which system's rule picks the prefiller (module docstring)."""

    PROFILE = "profile"
    DYNAMO_KV = "dynamo-kv"
    LLM_D = "llm-d"
    CACHE_AWARE = "cache-aware"


@record
class PrefillLoad:
    """What a peer's router knows of one prefill worker for one request:
    ``active_tokens``, prompt tokens routed there without a first token yet;
    ``cached_tokens``, the request's leading tokens its prefix cache holds;
    ``waiting``, its scraped waiting queue; ``in_flight``, the router's requests on
    it; ``routed_tokens``, the prompt tokens routed there so far."""

    name: str
    active_tokens: int
    cached_tokens: int
    waiting: int = 0
    in_flight: int = 0
    routed_tokens: int = 0


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


def _first_best(keys: Sequence[tuple[float, ...]]) -> int:
    """The index of the smallest key, the first of equals."""
    return min(range(len(keys)), key=lambda i: (keys[i], i))


def llm_d_pick(loads: Sequence[PrefillLoad], prompt_tokens: int, block_size: int) -> str:
    """The worker llm-d's sample prefill profile picks (module docstring)."""
    if not loads:
        raise ValueError("no prefill worker to pick from")
    total = blocks_of(prompt_tokens, block_size)
    low = min(load.waiting for load in loads)
    high = max(load.waiting for load in loads)
    scores = []
    for load in loads:
        prefix = min(load.cached_tokens // block_size, total) / total if total else 0.0
        queue = 1.0 if high == low else (high - load.waiting) / (high - low)
        scores.append((-(LLM_D_PREFIX_WEIGHT * prefix + LLM_D_QUEUE_WEIGHT * queue),))
    return loads[_first_best(scores)].name


def cache_aware_pick(loads: Sequence[PrefillLoad], prompt_tokens: int) -> str:
    """The worker vllm-router's ``cache_aware`` policy picks (module docstring)."""
    if not loads:
        raise ValueError("no prefill worker to pick from")
    low = min(load.in_flight for load in loads)
    high = max(load.in_flight for load in loads)
    if high - low > CACHE_AWARE_ABS_IMBALANCE and high > CACHE_AWARE_REL_IMBALANCE * low:
        return loads[_first_best([(float(load.in_flight),) for load in loads])].name
    rates = [load.cached_tokens / prompt_tokens if prompt_tokens else 0.0 for load in loads]
    best = _first_best([(-rate,) for rate in rates])
    if rates[best] > CACHE_AWARE_MATCH:
        return loads[best].name
    return loads[_first_best([(float(load.routed_tokens),) for load in loads])].name
