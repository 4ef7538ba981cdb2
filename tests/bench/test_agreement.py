"""Virtual and live runs of one small workload agree, under a fixed threshold and
under the ``goodput`` cost model (the same planner and policy in both).

Tolerance: TTFT p50 and TPOT p50 within 25% (plus 5 ms), the decision mix within 2
requests, prefill tokens within 10% and KV bytes within 20%. Live: simulators
(one decoder, one prefiller, H200 profile; their KV events feed the gateway's
precise prefix index, as the virtual fleet's planner reads the engines' caches)
behind our gateway on loopback, at time
scale 3 (a simulated second lasts three real ones), so the real HTTP and process
overhead -- which the virtual fleet models as a fixed per-leg hop -- weighs a third
as much in simulated time. Observed: TTFT p50 within 2%, TPOT p50 within 7%,
identical decisions, prefill tokens and KV bytes.
"""

from __future__ import annotations

import pytest

from pd_orchestrator.bench.fleet import preset_fleet
from pd_orchestrator.bench.live import LiveOptions, _stretched, live_threshold, run_fleet_strategy
from pd_orchestrator.bench.results import Slo, summarize
from pd_orchestrator.bench.strategies import resolve_strategies
from pd_orchestrator.bench.virtual import VirtualFleet
from pd_orchestrator.bench.workloads import WorkloadOptions, build_workload
from pd_orchestrator.cli.bench import ROUTING_PRESETS
from pd_orchestrator.model.hardware import get_profile
from pd_orchestrator.policies.plugins import builtin_registry
from pd_orchestrator.routing import RoutingConfig, build_profiles


def _close(live: float | None, virtual: float | None) -> bool:
    assert live is not None and virtual is not None
    return abs(live - virtual) <= 0.25 * virtual + 0.005


@pytest.mark.timeout(90)
@pytest.mark.parametrize("name", ["static-0.5", "goodput"])
def test_virtual_and_live_agree_on_a_small_workload(name: str) -> None:
    workload = build_workload(
        "shared-prefix", WorkloadOptions(requests=12, rate=4.0, size_scale=0.5, seed=1)
    )
    fleet = preset_fleet("tiny")
    (strategy,) = resolve_strategies([name])
    routing = build_profiles(
        RoutingConfig.model_validate(ROUTING_PRESETS["affinity"]), builtin_registry()
    )
    virtual = summarize(VirtualFleet(fleet, strategy, routing).run(workload), Slo())
    options = LiveOptions(sim_time_scale=3.0)
    live = summarize(run_fleet_strategy(fleet, strategy, workload, options), Slo())
    assert live.errors == 0 and live.completed == len(workload)
    print(f"TTFT p50 live {live.ttft_p50} virtual {virtual.ttft_p50}")
    print(f"TPOT p50 live {live.tpot_p50} virtual {virtual.tpot_p50}")
    print(f"decisions live {live.decisions} virtual {virtual.decisions}")
    assert _close(live.ttft_p50, virtual.ttft_p50)
    assert _close(live.tpot_p50, virtual.tpot_p50)
    for decision in ("decode", "pd"):
        assert abs(live.decisions.get(decision, 0) - virtual.decisions.get(decision, 0)) <= 2
    assert live.prefill_tokens == pytest.approx(virtual.prefill_tokens, rel=0.1)
    assert live.kv_bytes == pytest.approx(virtual.kv_bytes, rel=0.2)


def test_a_live_gateway_holds_the_simulated_fleet_to_the_strategy_s_targets() -> None:
    """At time scale 3 a simulated second lasts three on the gateway's clock: the
    latency targets of the policy block (at any depth) are stretched by 3, and
    ``goodput`` gets ``time_scale`` 3; nothing else changes."""
    slo = Slo(0.5, 0.02, 2.0, get_profile("h200-llama3-8b"))
    (goodput, static) = resolve_strategies(["goodput", "static-0.5"], slo=slo)
    block = live_threshold(goodput, 3.0)
    assert block["policy"]["params"] == {
        "ttft": pytest.approx(1.5),
        "tpot": pytest.approx(0.06),
        "ttft_scale": 2.0,  # a ratio of two durations: the same on any clock
        "attainment": 0.9,  # a share of requests: the same on any clock
        "time_scale": 3.0,  # goodput's knowledge on the gateway's clock
    }
    assert live_threshold(goodput) == goodput.threshold.model_dump(mode="json", exclude_unset=True)
    assert live_threshold(static, 3.0)["policy"] == {"type": "static", "value": 0.5}
    nested = {"type": "min", "children": [{"type": "slo-feedback", "params": {"itl_p99": 0.05}}]}
    assert _stretched(nested, 2.0)["children"][0]["params"] == {"itl_p99": 0.1}


@pytest.mark.timeout(120)
def test_a_live_run_behind_two_gateway_processes_serves_every_request_once() -> None:
    """``gateways=2``: two gateway processes on one port (``listen.workers``); every
    request is served and each decision is counted once, summed over the workers'
    own ``/metrics``."""
    workload = build_workload(
        "shared-prefix", WorkloadOptions(requests=12, rate=4.0, size_scale=0.5, seed=1)
    )
    (strategy,) = resolve_strategies(["goodput"])
    options = LiveOptions(sim_time_scale=2.0, gateways=2)
    result = run_fleet_strategy(preset_fleet("tiny"), strategy, workload, options)
    summary = summarize(result, Slo())
    assert summary.errors == 0 and summary.completed == len(workload)
    goodput = {k: v for k, v in result.reasons.items() if k.startswith("goodput:")}
    assert sum(goodput.values()) == len(workload), result.reasons
