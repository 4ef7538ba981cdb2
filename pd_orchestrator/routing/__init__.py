"""Routing (pure): profiles of filters -> weighted scorers -> picker, built from
configuration through a registry of plugin types.

Typical use::

    profiles = build_profiles(config.routing, routing_registry())
    result = profiles.decode.run(request, candidates)
    if result.empty:
        ...  # 503: result.describe_drops() says which filters removed whom
    decoder = result.endpoints[0]
    profiles.decode.observe(request, decoder)  # plugins that learn from decisions
"""

from pd_orchestrator.config.routing import (
    DecodeProfileConfig,
    PluginSpec,
    PrefillProfileConfig,
    ProfileConfig,
    RoutingConfig,
    ScorerSpec,
)
from pd_orchestrator.model.load import Candidate, LoadSnapshot
from pd_orchestrator.routing.builtins import BUILTIN_TYPES, routing_registry
from pd_orchestrator.routing.engine import (
    PluginContractError,
    Profile,
    Stage,
    WeightedScorer,
    clamp,
)
from pd_orchestrator.routing.interfaces import Filter, Observer, Picker, PluginContext, Scorer
from pd_orchestrator.routing.profiles import RoutingProfiles, build_profile, build_profiles
from pd_orchestrator.routing.registry import (
    FILTER,
    PICKER,
    SCORER,
    NoParams,
    PluginKind,
    PluginType,
    Registry,
    RoutingConfigError,
)
from pd_orchestrator.routing.types import RoutingRequest, RoutingResult, ScoredCandidate

__all__ = [
    "BUILTIN_TYPES",
    "FILTER",
    "PICKER",
    "SCORER",
    "Candidate",
    "DecodeProfileConfig",
    "Filter",
    "LoadSnapshot",
    "NoParams",
    "Observer",
    "Picker",
    "PluginContext",
    "PluginContractError",
    "PluginKind",
    "PluginSpec",
    "PluginType",
    "PrefillProfileConfig",
    "Profile",
    "ProfileConfig",
    "Registry",
    "RoutingConfig",
    "RoutingConfigError",
    "RoutingProfiles",
    "RoutingRequest",
    "RoutingResult",
    "ScoredCandidate",
    "Scorer",
    "ScorerSpec",
    "Stage",
    "WeightedScorer",
    "build_profile",
    "build_profiles",
    "clamp",
    "routing_registry",
]
