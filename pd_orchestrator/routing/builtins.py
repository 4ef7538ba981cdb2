"""The built-in plugin types and a registry holding them (threshold policies included)."""

from __future__ import annotations

from typing import Any

from pd_orchestrator.routing.filters import COMPATIBILITY, HEALTHY, MODEL, ROLE
from pd_orchestrator.routing.pickers import MAX_SCORE, WEIGHTED_RANDOM
from pd_orchestrator.routing.registry import PluginType, Registry
from pd_orchestrator.routing.scorers import HARDWARE_WEIGHT, KV_USAGE, QUEUE_DEPTH

__all__ = ["BUILTIN_TYPES", "builtin_registry"]

BUILTIN_TYPES: tuple[PluginType[Any, Any], ...] = (
    HEALTHY,
    MODEL,
    ROLE,
    COMPATIBILITY,
    QUEUE_DEPTH,
    KV_USAGE,
    HARDWARE_WEIGHT,
    MAX_SCORE,
    WEIGHTED_RANDOM,
)


def builtin_registry() -> Registry:
    """A new registry holding the built-in types (register more on it as needed): the
    routing plugins above and the threshold policies (kind ``policy``)."""
    # Imported here: the policies build on this package's registry and types, so a
    # module-level import would be circular.
    from pd_orchestrator.policies.plugins import register_policies

    return register_policies(Registry(BUILTIN_TYPES))
