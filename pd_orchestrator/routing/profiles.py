"""Building profiles from the ``routing:`` configuration through a registry."""

from __future__ import annotations

from pd_orchestrator.config.routing import ProfileConfig, RoutingConfig, duplicate_plugin_names
from pd_orchestrator.model.records import record
from pd_orchestrator.routing.engine import Profile, Stage, WeightedScorer
from pd_orchestrator.routing.registry import FILTER, PICKER, SCORER, Registry, RoutingConfigError

__all__ = ["RoutingProfiles", "build_profile", "build_profiles"]


@record
class RoutingProfiles:
    """The built ``decode`` and ``prefill`` profiles."""

    decode: Profile
    prefill: Profile


def build_profile(name: str, config: ProfileConfig, registry: Registry) -> Profile:
    """The profile ``config`` describes; :class:`RoutingConfigError` names any bad plugin."""
    duplicates = duplicate_plugin_names(config)
    if duplicates:
        kind = next(k for k, spec in config.plugin_specs() if spec.instance_name == duplicates[0])
        raise RoutingConfigError(name, kind, duplicates[0], "duplicate plugin name")
    filters = tuple(
        Stage(spec.instance_name, spec.type, registry.build(FILTER, spec, name))
        for spec in config.filters
    )
    scorers = tuple(
        WeightedScorer(
            spec.instance_name, spec.type, spec.weight, registry.build(SCORER, spec, name)
        )
        for spec in config.scorers
    )
    picker = Stage(
        config.picker.instance_name, config.picker.type, registry.build(PICKER, config.picker, name)
    )
    return Profile(name, filters, scorers, picker)


def build_profiles(config: RoutingConfig, registry: Registry) -> RoutingProfiles:
    """Both profiles of ``config``, built through ``registry``."""
    return RoutingProfiles(
        decode=build_profile("decode", config.decode, registry),
        prefill=build_profile("prefill", config.prefill, registry),
    )
