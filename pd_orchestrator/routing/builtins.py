"""The built-in routing plugin types and a registry holding them.

``routing_registry(precise_index)`` binds the ``precise-prefix`` scorer to the
shared index the KV-event subscriber feeds; without an index the type is still
known, and building it is an error that says what to configure.
"""

from __future__ import annotations

from typing import Any

from pd_orchestrator.prefix.index import PreciseIndex
from pd_orchestrator.routing.filters import COMPATIBILITY, HEALTHY, MODEL, ROLE
from pd_orchestrator.routing.pickers import MAX_SCORE, WEIGHTED_RANDOM
from pd_orchestrator.routing.prefix_scorers import (
    APPROXIMATE_PREFIX,
    PREFIX_AFFINITY,
    precise_prefix_type,
)
from pd_orchestrator.routing.registry import PluginType, Registry
from pd_orchestrator.routing.scorers import HARDWARE_WEIGHT, KV_USAGE, QUEUE_DEPTH

__all__ = ["BUILTIN_TYPES", "routing_registry"]

BUILTIN_TYPES: tuple[PluginType[Any, Any], ...] = (
    HEALTHY,
    MODEL,
    ROLE,
    COMPATIBILITY,
    QUEUE_DEPTH,
    KV_USAGE,
    HARDWARE_WEIGHT,
    APPROXIMATE_PREFIX,
    PREFIX_AFFINITY,
    MAX_SCORE,
    WEIGHTED_RANDOM,
)


def routing_registry(precise_index: PreciseIndex | None = None) -> Registry:
    """A new registry holding the built-in routing plugin types, ``precise-prefix`` bound
    to ``precise_index``. The threshold policies build on it
    (:func:`pd_orchestrator.policies.plugins.builtin_registry`)."""
    return Registry((*BUILTIN_TYPES, precise_prefix_type(precise_index)))
