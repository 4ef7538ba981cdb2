"""The built-in policy types, registered on a routing registry as kind ``policy``.

Leaf types: ``static``, ``min-uncached-tokens``, ``load-adaptive``, ``slo-feedback``, and
the peers' rules ``dynamo``, ``dynamo-legacy`` and ``llm-d``, and the cost model ``goodput``.
Types with child policies, built through the registry they are registered on:
``max``, ``min``, ``weighted``, ``overrides``.
"""

from __future__ import annotations

from typing import Any

from pd_orchestrator.policies.compose import composite_types
from pd_orchestrator.policies.goodput import GOODPUT
from pd_orchestrator.policies.load_adaptive import LOAD_ADAPTIVE
from pd_orchestrator.policies.min_uncached import MIN_UNCACHED_TOKENS
from pd_orchestrator.policies.overrides import overrides_type
from pd_orchestrator.policies.peers import DYNAMO, DYNAMO_LEGACY, LLM_D
from pd_orchestrator.policies.slo_feedback import SLO_FEEDBACK
from pd_orchestrator.policies.static import STATIC
from pd_orchestrator.prefix.index import PreciseIndex
from pd_orchestrator.routing.builtins import routing_registry
from pd_orchestrator.routing.registry import PluginType, Registry

__all__ = ["LEAF_POLICY_TYPES", "builtin_registry", "register_policies"]

LEAF_POLICY_TYPES: tuple[PluginType[Any, Any], ...] = (
    STATIC,
    MIN_UNCACHED_TOKENS,
    LOAD_ADAPTIVE,
    SLO_FEEDBACK,
    DYNAMO,
    DYNAMO_LEGACY,
    LLM_D,
    GOODPUT,
)


def register_policies(registry: Registry) -> Registry:
    """Register every built-in policy type on ``registry``; returns it."""
    for plugin_type in (*LEAF_POLICY_TYPES, *composite_types(registry), overrides_type(registry)):
        registry.register(plugin_type)
    return registry


def builtin_registry(precise_index: PreciseIndex | None = None) -> Registry:
    """A new registry holding every built-in type: the routing plugins (``precise-prefix``
    bound to ``precise_index``) and the threshold policies (kind ``policy``). Register
    more types on it as needed."""
    return register_policies(routing_registry(precise_index))
