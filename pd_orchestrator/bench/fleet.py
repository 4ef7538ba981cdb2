"""Benchmark fleets: which simulated instances exist, their hardware, role and group.

Presets:

* ``h200`` -- Llama-3.1-8B on H200: 12 decoders and 4 prefillers (16 instances);
* ``mixed`` -- half H200, half MI325X (same model), each half with its own
  decoders and prefillers in its own compatibility group (NIXL does not join a
  CUDA prefiller and a ROCm decoder);
* ``h200-8x8`` -- the same H200s, 8 decoders and 8 prefillers (a fleet where the
  prefill pool is as large as the decode pool);
* ``tiny`` -- one H200 decoder and one H200 prefiller (tests, agreement checks).

``decoders`` and ``prefillers`` override a preset's counts (for ``mixed``: totals,
split evenly between the two hardware kinds). A fleet can also come from a gateway
configuration whose endpoints have ``sim`` blocks (:meth:`FleetSpec.from_config`).
"""

from __future__ import annotations

from dataclasses import replace

from pd_orchestrator.config.settings import GatewayConfig
from pd_orchestrator.model.endpoints import Endpoint, Role
from pd_orchestrator.model.hardware import LatencyProfile, get_profile
from pd_orchestrator.model.measured import knowledge_for, resolve_profile
from pd_orchestrator.model.records import record

__all__ = ["FLEETS", "FleetSpec", "InstanceSpec", "preset_fleet"]

FLEETS = ("h200", "mixed", "h200-8x8", "tiny")

_PRESETS: dict[str, tuple[tuple[str, str], ...]] = {
    "h200": (("h200-llama3-8b", "nvidia"),),
    "mixed": (("h200-llama3-8b", "nvidia"), ("mi325x-llama3-8b", "amd")),
    "h200-8x8": (("h200-llama3-8b", "nvidia"),),
    "tiny": (("h200-llama3-8b", "nvidia"),),
}
_COUNTS = {"h200": (12, 4), "mixed": (12, 4), "h200-8x8": (8, 8), "tiny": (1, 1)}


@record
class InstanceSpec:
    """One simulated instance: name, latency profile (a built-in name or a profile
    file), role and compatibility group; ``spill``: a prefiller that also serves whole
    requests (its pool's ``spill``); ``known``: the router is told its profile (False:
    a policy starts from seeds and learns, as on an unmeasured deployment)."""

    name: str
    profile: str
    role: Role
    group: str
    spill: bool = False
    known: bool = True

    @property
    def latency(self) -> LatencyProfile:
        return resolve_profile(self.profile)

    def endpoint(self, url: str | None = None) -> Endpoint:
        """The instance as the router sees it (``url`` defaults to a virtual one)."""
        latency = self.latency
        return Endpoint(
            name=self.name,
            url=url or f"http://virtual.invalid/{self.name}",
            role=self.role,
            hardware=latency.hardware,
            model=latency.model,
            pool=f"{latency.hardware}-{self.role.value}",
            group=self.group,
            spill=self.spill,
            knowledge=knowledge_for(self.profile) if self.known else None,
        )


@record
class FleetSpec:
    """Instances and the engine settings they share; ``kv_capacity_tokens`` overrides
    every profile's KV capacity (memory-pressure experiments)."""

    name: str
    instances: tuple[InstanceSpec, ...]
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    kv_capacity_tokens: int | None = None

    def capacity(self, instance: InstanceSpec) -> int:
        """KV capacity of ``instance`` in tokens."""
        return self.kv_capacity_tokens or instance.latency.capacity_tokens

    def __post_init__(self) -> None:
        names = [i.name for i in self.instances]
        if len(set(names)) != len(names):
            raise ValueError("instance names must be unique")
        if not any(i.role.decodes for i in self.instances):
            raise ValueError(f"fleet {self.name!r} has no decoder")
        models = {i.latency.model for i in self.instances}
        if len(models) != 1:
            raise ValueError(f"fleet {self.name!r} mixes models: {', '.join(sorted(models))}")

    @property
    def model(self) -> str:
        return self.instances[0].latency.model

    @property
    def decoders(self) -> tuple[InstanceSpec, ...]:
        return tuple(i for i in self.instances if i.role.decodes)

    @property
    def prefillers(self) -> tuple[InstanceSpec, ...]:
        return tuple(i for i in self.instances if i.role.prefills)

    def prefill_latency(self, reference_tokens: int = 4096) -> LatencyProfile:
        """The prefill hardware a request running alone would get: the profile of the
        prefillers (every instance in a fleet with none) that computes a cold prompt of
        ``reference_tokens`` fastest."""
        pool = self.prefillers or self.instances
        profiles = {i.profile: i.latency for i in pool}
        return min(
            profiles.values(), key=lambda latency: latency.prefill_seconds(reference_tokens, 0)
        )

    def unprofiled(self) -> FleetSpec:
        """The same instances, their profiles kept from the router (``--no-profile``)."""
        instances = tuple(replace(i, known=False) for i in self.instances)
        return replace(self, instances=instances)

    def aggregated(self) -> FleetSpec:
        """The same instances, every one a decoder (decode-only serving)."""
        instances = tuple(replace(i, role=Role.DECODE, spill=False) for i in self.instances)
        return replace(self, name=f"{self.name}-aggregated", instances=instances)

    def flexible(self) -> FleetSpec:
        """The same instances, every prefiller also a decoder (role ``both``): decode-first
        requests may be served on any instance, P/D prefills go to the former
        prefillers."""
        instances = tuple(
            replace(i, role=Role.BOTH, spill=False) if i.role is Role.PREFILL else i
            for i in self.instances
        )
        return replace(self, name=f"{self.name}-flex", instances=instances)

    def spilling(self) -> FleetSpec:
        """The same instances, every prefiller's pool spilling: a prefiller also serves
        whole requests a threshold policy sends it (``goodput``, when a decoder is
        crowded or queued); P/D prefills still go there."""
        instances = tuple(
            replace(i, spill=True) if i.role is Role.PREFILL else i for i in self.instances
        )
        return replace(self, name=f"{self.name}-spill", instances=instances)

    def describe(self) -> str:
        """``12 decode + 4 prefill (h200-llama3-8b)`` style summary."""
        parts = []
        for profile in sorted({i.profile for i in self.instances}):
            members = [i for i in self.instances if i.profile == profile]
            decode = sum(i.role is Role.DECODE for i in members)
            prefill = sum(i.role is Role.PREFILL for i in members)
            both = len(members) - decode - prefill
            counts = f"{decode} decode + {prefill} prefill" + (f" + {both} both" if both else "")
            parts.append(f"{counts} ({profile})")
        return ", ".join(parts)

    @classmethod
    def from_config(cls, config: GatewayConfig, name: str = "config") -> FleetSpec:
        """The simulated endpoints of a gateway configuration (each needs a ``sim`` block)."""
        instances = []
        for endpoint in config.fleet():
            if endpoint.sim is None:
                raise ValueError(f"endpoint {endpoint.name!r} has no sim block")
            instances.append(
                InstanceSpec(
                    endpoint.name,
                    endpoint.sim.profile,
                    Role(endpoint.role),
                    endpoint.group,
                    spill=endpoint.spill,
                )
            )
        return cls(name, tuple(instances))


def preset_fleet(
    name: str, decoders: int | None = None, prefillers: int | None = None
) -> FleetSpec:
    """The preset called ``name`` (one of :data:`FLEETS`), optionally resized."""
    if name not in _PRESETS:
        raise ValueError(f"unknown fleet {name!r} (known: {', '.join(FLEETS)})")
    kinds = _PRESETS[name]
    default_d, default_p = _COUNTS[name]
    total_d = default_d if decoders is None else decoders
    total_p = default_p if prefillers is None else prefillers
    if total_d < len(kinds) or total_p < 0:
        raise ValueError(f"fleet {name!r} needs at least {len(kinds)} decoder(s)")
    instances: list[InstanceSpec] = []
    for k, (profile, group) in enumerate(kinds):
        hardware = get_profile(profile).hardware
        share_d = total_d // len(kinds) + (k < total_d % len(kinds))
        share_p = total_p // len(kinds) + (k < total_p % len(kinds))
        instances += [
            InstanceSpec(f"{hardware}-d{i}", profile, Role.DECODE, group) for i in range(share_d)
        ]
        instances += [
            InstanceSpec(f"{hardware}-p{i}", profile, Role.PREFILL, group) for i in range(share_p)
        ]
    return FleetSpec(name, tuple(instances))
