"""The ``routing:`` configuration block: one pipeline ("profile") per routing role.

A profile names its plugins; the plugins themselves (types, parameters) are
resolved by a :class:`~pd_orchestrator.routing.registry.Registry` when the
profiles are built (:func:`~pd_orchestrator.routing.profiles.build_profiles`), so
this module only checks the shape. The YAML::

    routing:
      decode:                      # ranks decoders for the decode-first attempt
        filters:                   # applied in order; each keeps a subset
          - {type: healthy}
          - {type: model}
          - {type: role}
        scorers:                   # each score is clamped to [0, 1], then weighted
          - {type: queue-depth, weight: 2}
          - {type: kv-usage, weight: 1}
          - type: hardware-weight
            name: hw               # optional; defaults to the type
            weight: 1              # >= 0; defaults to 1
            params: {weights: {h200: 1.0, mi325x: 0.9}}
        picker: {type: max-score}
      prefill:                     # ranks prefillers for the chosen decoder
        filters: [{type: healthy}, {type: role}, {type: compatibility}]
        scorers: [{type: queue-depth, weight: 1}]
        picker: {type: weighted-random, params: {seed: 7}}

Every plugin entry has ``type``, an optional ``name`` and optional ``params`` (a
mapping validated by the plugin type's own strict model); scorers also have
``weight``. Within one profile the names (explicit or defaulted to the type) must
be unique across filters, scorers and the picker, so two scorers of one type need
explicit names. Unknown keys are errors at every level. A profile left out, and
each key left out of a profile, keeps its default (:class:`DecodeProfileConfig`,
:class:`PrefillProfileConfig`); a list given replaces the default list.
"""

from __future__ import annotations

from typing import Annotated, Self

from pydantic import BaseModel, ConfigDict, Field, JsonValue, model_validator

__all__ = [
    "DecodeProfileConfig",
    "PluginSpec",
    "PrefillProfileConfig",
    "ProfileConfig",
    "RoutingConfig",
    "ScorerSpec",
    "duplicate_plugin_names",
]

PluginName = Annotated[str, Field(min_length=1, pattern=r"^[A-Za-z0-9_.\-]+$")]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PluginSpec(_Strict):
    """One plugin instance: its type, an optional name and the type's parameters."""

    type: PluginName
    name: PluginName | None = None
    params: dict[str, JsonValue] = Field(
        default_factory=dict, description="validated by the plugin type's own model"
    )

    @property
    def instance_name(self) -> str:
        """The name, or the type when no name is given."""
        return self.name or self.type


class ScorerSpec(PluginSpec):
    """A scorer instance and the weight of its (clamped) score."""

    weight: Annotated[float, Field(ge=0.0, allow_inf_nan=False)] = 1.0


class ProfileConfig(_Strict):
    """Filters, weighted scorers and a picker (default: none, none, ``max-score``)."""

    filters: list[PluginSpec] = Field(default_factory=list)
    scorers: list[ScorerSpec] = Field(default_factory=list)
    picker: PluginSpec = Field(default_factory=lambda: PluginSpec(type="max-score"))

    def plugin_specs(self) -> list[tuple[str, PluginSpec]]:
        """``(kind, spec)`` of every plugin, in pipeline order."""
        return [
            *(("filter", spec) for spec in self.filters),
            *(("scorer", spec) for spec in self.scorers),
            ("picker", self.picker),
        ]


def duplicate_plugin_names(profile: ProfileConfig) -> list[str]:
    """Instance names used more than once in ``profile`` (sorted)."""
    names = [spec.instance_name for _, spec in profile.plugin_specs()]
    return sorted({name for name in names if names.count(name) > 1})


def _specs(*types: str) -> list[PluginSpec]:
    return [PluginSpec(type=t) for t in types]


class DecodeProfileConfig(ProfileConfig):
    """The decode profile; each key left out keeps its default: filters ``healthy``,
    ``model``, ``role``; scorers ``queue-depth`` (weight 2) and ``kv-usage`` (weight 1);
    picker ``max-score``."""

    filters: list[PluginSpec] = Field(default_factory=lambda: _specs("healthy", "model", "role"))
    scorers: list[ScorerSpec] = Field(
        default_factory=lambda: [
            ScorerSpec(type="queue-depth", weight=2.0),
            ScorerSpec(type="kv-usage", weight=1.0),
        ]
    )


class PrefillProfileConfig(ProfileConfig):
    """The prefill profile; each key left out keeps its default: filters ``healthy``,
    ``model``, ``role``, ``compatibility``; scorer ``queue-depth`` (weight 1); picker
    ``max-score``. A ``filters`` list replaces the default one, so keep
    ``compatibility`` in it unless every prefiller can reach every decoder."""

    filters: list[PluginSpec] = Field(
        default_factory=lambda: _specs("healthy", "model", "role", "compatibility")
    )
    scorers: list[ScorerSpec] = Field(
        default_factory=lambda: [ScorerSpec(type="queue-depth", weight=1.0)]
    )


class RoutingConfig(_Strict):
    """The ``decode`` and ``prefill`` profiles (defaults: see their models)."""

    decode: DecodeProfileConfig = Field(default_factory=DecodeProfileConfig)
    prefill: PrefillProfileConfig = Field(default_factory=PrefillProfileConfig)

    def profiles(self) -> dict[str, ProfileConfig]:
        """Every profile by name."""
        return {"decode": self.decode, "prefill": self.prefill}

    @model_validator(mode="after")
    def _unique_names(self) -> Self:
        for profile_name, profile in self.profiles().items():
            duplicates = duplicate_plugin_names(profile)
            if duplicates:
                raise ValueError(
                    f"profile {profile_name!r}: duplicate plugin name(s) "
                    f"{', '.join(map(repr, duplicates))}; give each instance its own `name`"
                )
        return self
