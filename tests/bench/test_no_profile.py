"""The virtual bench with ``--no-profile``: the policies are not told the
instances' latency profiles and learn them online, as on an unmeasured deployment."""

from __future__ import annotations

import argparse

from pd_orchestrator.bench.strategies import resolve_strategies
from pd_orchestrator.bench.virtual import VirtualFleet
from pd_orchestrator.bench.workloads import BenchRequest, Segment, Workload
from pd_orchestrator.cli.bench import ROUTING_PRESETS, _fleet
from pd_orchestrator.model.hardware import get_profile
from pd_orchestrator.policies.goodput import GoodputParams, GoodputPolicy
from pd_orchestrator.policies.goodput_model import knowledge_of
from pd_orchestrator.policies.plugins import builtin_registry
from pd_orchestrator.routing import RoutingConfig, build_profiles

AFFINITY = build_profiles(
    RoutingConfig.model_validate(ROUTING_PRESETS["affinity"]), builtin_registry()
)


def _args(*, no_profile: bool) -> argparse.Namespace:
    return argparse.Namespace(
        fleet="tiny", decoders=None, prefillers=None, prefill_role="split", no_profile=no_profile
    )


def test_no_profile_keeps_the_profiles_from_the_router_not_from_the_engines() -> None:
    known, unknown = _fleet(_args(no_profile=False)), _fleet(_args(no_profile=True))
    assert [i.latency for i in unknown.instances] == [i.latency for i in known.instances]
    assert {knowledge_of(i.endpoint()) for i in known.instances} == {
        "simulator profile h200-llama3-8b"
    }
    assert {knowledge_of(i.endpoint()) for i in unknown.instances} == {"seeds"}


def test_goodput_with_no_profile_starts_from_the_seeds_and_learns_the_local_rate() -> None:
    """Cold prompts one after another, served locally: the local rate moves from the
    seed (20k tokens/s) towards the engine's (H200: 1 / 29.5 us, about 33.9k)."""
    fleet = _fleet(_args(no_profile=True))
    (strategy,) = resolve_strategies(["goodput"])
    virtual = VirtualFleet(fleet, strategy, AFFINITY)
    requests = tuple(
        BenchRequest(i, f"s{i}", 0, (Segment(100 + i, 2_000),), max_tokens=4, arrival=2.0 * i)
        for i in range(40)
    )
    result = virtual.run(Workload("test", "test", requests))
    assert all(r.ok for r in result.records)
    resolver = virtual.planner.threshold
    assert resolver is not None and isinstance(resolver.policy, GoodputPolicy)
    (pool,) = (p for name, p in resolver.policy.model.pools.items() if "decode" in name)
    seed, engine = GoodputParams().prefill_tokens_per_s, 1 / get_profile("h200-llama3-8b").lin
    assert pool.profile is None and pool.seed == seed
    assert pool.rate_local > seed + 0.5 * (engine - seed)
