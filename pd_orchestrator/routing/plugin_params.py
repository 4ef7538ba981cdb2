"""The built-in routing plugins' parameters, validated from configuration.

The plugins themselves (:mod:`~pd_orchestrator.routing.filters`,
:mod:`~pd_orchestrator.routing.scorers`, :mod:`~pd_orchestrator.routing.pickers`)
run on every request and are compiled (setup.py); their parameters are pydantic
models, which a compiled module may not define, so they live here. Each plugin
module exports its own.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from pd_orchestrator.routing.registry import NoParams

__all__ = [
    "CompatibilityParams",
    "GroupPair",
    "HardwareWeightParams",
    "HealthyParams",
    "KvUsageParams",
    "MaxScoreParams",
    "WeightedRandomParams",
]

Weight = Annotated[float, Field(ge=0.0, allow_inf_nan=False)]


class HealthyParams(NoParams):
    """``require_load`` (default false): also drop candidates without a load reading
    (stale or never read). ``max_load_age`` (seconds, default none): with
    ``require_load``, a reading older than this at ``request.now`` counts as absent.
    ``panic`` (default true): when no candidate passes, keep them all (Envoy's panic
    routing): health checks can fail while an endpoint still serves (a busy server
    answers its health check late), and the request's own outcome then decides."""

    require_load: bool = False
    max_load_age: Annotated[float, Field(gt=0.0, allow_inf_nan=False)] | None = None
    panic: bool = True


class GroupPair(NoParams):
    """A prefill group whose KV may go to a decode group (e.g. host-staged transfers)."""

    prefill: Annotated[str, Field(min_length=1)]
    decode: Annotated[str, Field(min_length=1)]


class CompatibilityParams(NoParams):
    """``pairs`` (default empty): cross-group ``{prefill, decode}`` pairs allowed for
    every request; a request adds its own in ``allowed_pairs``."""

    pairs: list[GroupPair] = Field(default_factory=list)


class KvUsageParams(NoParams):
    """``missing`` (in [0, 1], default 0.5): the score of a candidate without a reading."""

    missing: Annotated[float, Field(ge=0.0, le=1.0)] = 0.5


class HardwareWeightParams(NoParams):
    """``weights`` (label -> weight >= 0, default empty) and ``default`` (>= 0,
    default 1.0) for hardware labels not listed."""

    weights: dict[str, Weight] = Field(default_factory=dict)
    default: Weight = 1.0


class MaxScoreParams(NoParams):
    """``tolerance`` (>= 0, default 1e-9): totals within this of the best count as tied.
    ``ties`` (default ``affinity``): ``affinity`` breaks ties by the request's affinity
    key when it has one; ``rotate`` always rotates (a round-robin among equals).
    ``load_bound`` (>= 1, default none): affinity with bounded loads -- a key's
    endpoint keeps it only while its queue depth is at most ``load_bound`` times the
    candidates' mean depth (plus one); past that, the key's next endpoint in hash
    order that is within the bound takes it."""

    tolerance: Annotated[float, Field(ge=0.0, allow_inf_nan=False)] = 1e-9
    ties: Literal["affinity", "rotate"] = "affinity"
    load_bound: Annotated[float, Field(ge=1.0, allow_inf_nan=False)] | None = None


class WeightedRandomParams(NoParams):
    """``seed`` (default 0): with the instance and the request's ``sequence``, fixes
    every draw."""

    seed: int = 0
