"""The virtual bench with ``--no-profile``: the policies are not told the
instances' latency profiles and learn them online, as on an unmeasured deployment."""

from __future__ import annotations

import argparse
from dataclasses import replace

import pytest

from pd_orchestrator.bench.strategies import resolve_strategies
from pd_orchestrator.bench.virtual import VirtualFleet
from pd_orchestrator.bench.workloads import (
    BenchRequest,
    Segment,
    Workload,
    WorkloadOptions,
    build_workload,
    warm_up_options,
    warmed,
)
from pd_orchestrator.cli.bench import ROUTING_PRESETS, _fleet, _warmed
from pd_orchestrator.model.hardware import LatencyProfile, get_profile
from pd_orchestrator.policies.goodput import GoodputParams, GoodputPolicy
from pd_orchestrator.policies.goodput_model import PoolModel, knowledge_of
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
    virtual = _from_traffic(VirtualFleet(fleet, strategy, AFFINITY))
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


def test_goodput_with_no_profile_learns_the_engine_s_attention_term() -> None:
    """Cold prompts of 2k to 32k tokens one after another, each alone on the fleet:
    the policy, told no attention term, learns one within a quarter of the simulated
    engine's (H200: 0.96 ns a pair), and from these requests alone prices a 32k-token
    prompt's local prefill, the fixed cost of a prefill and the step of one stream each
    within a tenth of what the engine takes."""
    fleet = _fleet(_args(no_profile=True))
    (strategy,) = resolve_strategies(["goodput"])
    virtual = _from_traffic(VirtualFleet(fleet, strategy, AFFINITY))
    lengths = [2_000, 4_000, 8_000, 16_000, 32_000] * 4
    requests = tuple(
        BenchRequest(i, f"s{i}", 0, (Segment(100 + i, n),), max_tokens=4, arrival=5.0 * i)
        for i, n in enumerate(lengths)
    )
    result = virtual.run(Workload("test", "test", requests))
    assert all(r.ok for r in result.records)
    resolver = virtual.planner.threshold
    assert resolver is not None and isinstance(resolver.policy, GoodputPolicy)
    (pool,) = (p for name, p in resolver.policy.model.pools.items() if "decode" in name)
    engine = get_profile("h200-llama3-8b")
    assert pool.profile is None and pool.fits_attn
    assert pool.attn == pytest.approx(engine.attn, rel=0.25)
    _priced_as_the_engine(pool, engine)


def _priced_as_the_engine(pool: PoolModel, engine: LatencyProfile) -> None:
    """``pool`` prices a 32k-token prefill, the fixed cost of one and a decode step of
    one stream (at 2k tokens of context) each within a tenth of ``engine``'s."""
    truth = engine.a_pf + engine.prefill_seconds(32_000, 0)
    assert pool.local_seconds(32_000, 32_000) == pytest.approx(truth, rel=0.1)
    assert pool.fixed == pytest.approx(engine.a_pf, rel=0.1)
    assert pool.steps.at(1) == pytest.approx(engine.step_seconds(2048, 1), rel=0.1)


def _cold(first: int, count: int, spacing: float) -> tuple[BenchRequest, ...]:
    return tuple(
        BenchRequest(i, f"s{first + i}", 0, (Segment(100 + first + i, 2_000),), 4, spacing * i)
        for i in range(count)
    )


def test_a_warm_up_is_learnt_from_not_counted_and_over_before_the_measured_start() -> None:
    fleet = _fleet(_args(no_profile=True))
    warm = Workload("test", "test", _cold(0, 40, 2.0))
    measured = Workload("test", "test", _cold(40, 5, 0.5))
    (strategy,) = resolve_strategies(["goodput"])
    alone = _from_traffic(VirtualFleet(fleet, strategy, AFFINITY)).run(warm)
    warm_end = max(r.arrival + (r.e2e or 0.0) for r in alone.records)

    (strategy,) = resolve_strategies(["goodput"])
    virtual = _from_traffic(VirtualFleet(fleet, strategy, AFFINITY))
    result = virtual.run(warmed(warm, measured, pause=3.0))
    assert [r.index for r in result.records] == [0, 1, 2, 3, 4]
    assert [r.session for r in result.records] == [f"s{40 + i}" for i in range(5)]
    arrivals = [r.arrival for r in result.records]
    assert arrivals == pytest.approx([warm_end + 3.0 + 0.5 * i for i in range(5)])
    # the policy learnt from the warm-up: its rate is further from the seed than the
    # measured requests alone take it
    (strategy,) = resolve_strategies(["goodput"])
    cold = _from_traffic(VirtualFleet(fleet, strategy, AFFINITY))
    cold.run(measured)
    assert _local_rate(virtual) > _local_rate(cold) >= GoodputParams().prefill_tokens_per_s


def _goodput(virtual: VirtualFleet) -> GoodputPolicy:
    resolver = virtual.planner.threshold
    assert resolver is not None and isinstance(resolver.policy, GoodputPolicy)
    return resolver.policy


def _from_traffic(virtual: VirtualFleet) -> VirtualFleet:
    """``virtual`` with its ``goodput`` policy timing nothing at start-up: what it knows
    comes from the workload's requests alone."""
    policy = _goodput(virtual)
    policy.params = policy.params.model_copy(update={"probe_tokens": ()})
    return virtual


def test_goodput_with_no_profile_times_the_pools_before_the_first_request() -> None:
    """The start-up probe, as the gateway sends it: before the workload's first request
    arrives, each pool has timed cold prompts of 2k to 32k tokens, from which the
    decoder pool learns its local rate and attention term and, through the prefiller's,
    its remote rate, each within a tenth of the simulated engine's (H200), with the
    engine's fixed prefill cost parted from them (within a tenth), a 32k-token prompt
    priced within a tenth of its time, and its decode step of one stream within a
    tenth of the engine's; with a profile, nothing is timed and the first request
    arrives at 0."""
    (strategy,) = resolve_strategies(["goodput"])
    request = BenchRequest(0, "s0", 0, (Segment(100, 100),), max_tokens=2, arrival=0.0)
    virtual = VirtualFleet(_fleet(_args(no_profile=True)), strategy, AFFINITY)
    (record,) = virtual.run(Workload("test", "test", (request,))).records
    assert record.ok and 1.0 < record.arrival < GoodputParams().probe_seconds
    (pool,) = (p for name, p in _goodput(virtual).model.pools.items() if "decode" in name)
    engine = get_profile("h200-llama3-8b")
    assert pool.profile is None and len(pool.alone_local) == len(pool.alone_remote) == 10
    assert pool.rate_local == pytest.approx(1 / engine.lin, rel=0.1)
    assert pool.rate_remote == pytest.approx(1 / engine.lin, rel=0.1)
    assert pool.attn == pytest.approx(engine.attn, rel=0.1)
    _priced_as_the_engine(pool, engine)
    (strategy,) = resolve_strategies(["goodput"])
    known = VirtualFleet(_fleet(_args(no_profile=False)), strategy, AFFINITY)
    (record,) = known.run(Workload("test", "test", (request,))).records
    assert record.arrival == 0.0


def _local_rate(virtual: VirtualFleet) -> float:
    resolver = virtual.planner.threshold
    assert resolver is not None and isinstance(resolver.policy, GoodputPolicy)
    (pool,) = (p for name, p in resolver.policy.model.pools.items() if "decode" in name)
    return pool.rate_local


def test_a_warm_up_shares_no_content_with_the_measured_requests() -> None:
    options = WorkloadOptions(requests=50, seed=3)
    measured = build_workload("shared-prefix", options)
    warm = build_workload("shared-prefix", warm_up_options("shared-prefix", options, 50))
    assert warm.requests != measured.requests  # another draw
    both = warmed(warm, measured, pause=0.0)
    assert both.warm_up == 50 and len(both) == 100
    keys = {s.key for r in both.requests[:50] for s in r.segments}
    assert not keys & {s.key for r in both.requests[50:] for s in r.segments}
    assert both.requests[50:] == tuple(
        replace(r, index=50 + r.index) for r in measured.requests
    )  # the measured requests as drawn, indexes after the warm-up's


def test_a_warm_up_is_for_virtual_runs_and_its_numbers_are_checked() -> None:
    args = argparse.Namespace(warm_up=10, warm_up_pause=1.0, virtual=False, workload="x", seed=0)
    with pytest.raises(ValueError, match="virtual"):
        _warmed(args, WorkloadOptions(), [])
    for bad in ({"warm_up": -1}, {"warm_up_pause": -1.0}):
        wrong = argparse.Namespace(**(vars(args) | {"virtual": True} | bad))
        with pytest.raises(ValueError, match="must be >= 0"):
            _warmed(wrong, WorkloadOptions(), [])
