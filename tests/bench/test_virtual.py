"""The virtual fleet: decisions, transfers and routing on tiny cases."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path
from typing import Any, ClassVar

import pytest

from pd_orchestrator.bench import virtual
from pd_orchestrator.bench.fleet import FleetSpec, preset_fleet
from pd_orchestrator.bench.results import RunResult, Slo
from pd_orchestrator.bench.strategies import (
    DEFAULT_STRATEGIES,
    load_policy_file,
    resolve_strategies,
)
from pd_orchestrator.bench.virtual import VirtualFleet, VirtualOptions
from pd_orchestrator.bench.workloads import (
    BenchRequest,
    Segment,
    Workload,
    WorkloadOptions,
    build_workload,
)
from pd_orchestrator.cli.bench import ROUTING_PRESETS, _fleet
from pd_orchestrator.flows.machine import Alone, Done, FlowMachine, Serve, Step, ThroughPD
from pd_orchestrator.model.endpoints import Role
from pd_orchestrator.model.hardware import get_profile
from pd_orchestrator.model.route import Route
from pd_orchestrator.policies.base import ThresholdContext
from pd_orchestrator.policies.goodput import GoodputPolicy
from pd_orchestrator.policies.plugins import builtin_registry
from pd_orchestrator.routing import RoutingConfig, build_profiles

AFFINITY = build_profiles(
    RoutingConfig.model_validate(ROUTING_PRESETS["affinity"]), builtin_registry()
)
KV_PER_TOKEN = get_profile("h200-llama3-8b").kv_bytes_per_token


def _workload(*prompts: tuple[float, tuple[Segment, ...]]) -> Workload:
    requests = tuple(
        BenchRequest(index=i, session=f"s{i}", turn=0, segments=segments, max_tokens=8, arrival=at)
        for i, (at, segments) in enumerate(prompts)
    )
    return Workload("test", "test", requests)


def _run(strategy: str, workload: Workload, fleet: FleetSpec | None = None) -> RunResult:
    (resolved,) = resolve_strategies([strategy])
    return VirtualFleet(fleet or preset_fleet("tiny"), resolved, AFFINITY).run(workload)


DOC = (Segment(11, 2000),)
COLD_THEN_WARM = _workload((0.0, DOC), (5.0, DOC))


def test_cold_goes_pd_and_warm_is_decoded_where_cached() -> None:
    result = _run("static-0.5", COLD_THEN_WARM)
    cold, warm = result.records
    assert (cold.decision, warm.decision) == ("pd", "decode")
    assert cold.prefiller == "h200-p0" and warm.prefiller is None
    assert cold.kv_bytes == 2000 * KV_PER_TOKEN and warm.kv_bytes == 0
    assert warm.cached_tokens == 1984  # full blocks, capped below the prompt length
    assert warm.ttft is not None and cold.ttft is not None and warm.ttft < cold.ttft / 3
    assert result.kv_bytes == cold.kv_bytes
    assert all(r.output_tokens == 8 and r.ok for r in result.records)
    assert len(result.itl_samples) == 2 * 7


def test_decode_only_never_prefills_remotely() -> None:
    result = _run("decode-only", COLD_THEN_WARM)
    assert [r.decision for r in result.records] == ["decode", "decode"]
    assert result.kv_bytes == 0 and {r.prefiller for r in result.records} == {None}
    # both tiny instances decode: one cold prefill, then a hit
    assert result.prefill_tokens <= 2000 + 16 + 2 * 8


def test_always_pd_prefills_every_request_and_moves_only_missing_kv() -> None:
    result = _run("always-pd", COLD_THEN_WARM)
    assert [r.decision for r in result.records] == ["pd", "pd"]
    cold, warm = result.records
    assert cold.kv_bytes == 2000 * KV_PER_TOKEN
    assert warm.kv_bytes == 16 * KV_PER_TOKEN  # the decoder already held all full blocks


def test_threshold_one_sends_everything_pd_and_zero_nothing() -> None:
    assert {r.decision for r in _run("static-1", COLD_THEN_WARM).records} == {"pd"}
    assert {r.decision for r in _run("static-0", COLD_THEN_WARM).records} == {"decode"}


def test_mixed_fleet_pairs_prefillers_within_their_group() -> None:
    fleet = preset_fleet("mixed", decoders=4, prefillers=2)
    prompts = [(0.1 * i, (Segment(100 + i, 3000),)) for i in range(24)]
    result = _run("always-pd", _workload(*prompts), fleet)
    pairs = {(r.decoder.split("-")[0], (r.prefiller or "").split("-")[0]) for r in result.records}
    assert pairs == {("h200", "h200"), ("mi325x", "mi325x")}


def test_multi_turn_later_turns_hit_their_decoder() -> None:
    workload = build_workload("multi-turn", WorkloadOptions(requests=40))
    result = _run("static-0.5", workload, preset_fleet("h200", decoders=4, prefillers=2))
    later = [r for r, q in zip(result.records, workload.requests, strict=True) if q.turn > 0]
    assert later and all(r.decision == "decode" for r in later)
    assert all(r.ok for r in result.records)
    assert len(result.records) == 40


def test_dynamo_legacy_rule_prefills_remotely_only_long_uncached_prompts() -> None:
    workload = _workload((0.0, (Segment(5, 900),)), (0.0, (Segment(6, 6000),)))
    result = _run("dynamo-legacy", workload)
    assert [r.decision for r in result.records] == ["decode", "pd"]
    short, long = result.records
    assert short.threshold == 0.0
    assert long.threshold == pytest.approx(1 - 1000.5 / 6000)
    assert result.reasons == {
        "dynamo-legacy:short-prompt": 1,
        "dynamo-legacy:uncached-length": 1,
    }


def test_dynamo_isl_bounding_sends_even_a_short_cold_prompt_remote() -> None:
    """Current Dynamo's default: a cold 900-token prompt has an uncached share of 1,
    above 0.7, so it goes P/D although it is under 2048 tokens."""
    result = _run("dynamo", _workload((0.0, (Segment(5, 900),)), (0.0, (Segment(6, 6000),))))
    assert [r.decision for r in result.records] == ["pd", "pd"]
    assert result.reasons == {"dynamo:effective-isl": 2}


def test_every_default_strategy_runs_with_the_gateway_policies() -> None:
    strategies = resolve_strategies(DEFAULT_STRATEGIES)
    assert {s.name for s in strategies} >= {"load-adaptive", "slo-feedback", "dynamo"}
    workload = build_workload("multi-turn", WorkloadOptions(requests=30))
    for strategy in strategies:
        fleet = preset_fleet("h200", decoders=2, prefillers=1)
        result = VirtualFleet(fleet, strategy, AFFINITY).run(workload)
        assert all(r.ok for r in result.records), strategy.name
        if strategy.threshold is not None:
            assert sum(result.reasons.values()) == len(workload), strategy.name


def test_slo_feedback_learns_from_the_latencies_it_is_told() -> None:
    """Targets no request can meet: ITL over target first, so the controller raises
    the threshold from its base (0.7) as observations arrive."""
    (strategy,) = resolve_strategies(["slo-feedback"], slo=Slo(ttft=0.001, tpot=0.0001))
    prompts = [(0.5 * i, (Segment(300 + i, 1500),)) for i in range(160)]
    result = VirtualFleet(preset_fleet("tiny"), strategy, AFFINITY).run(_workload(*prompts))
    thresholds = [r.threshold for r in result.records if r.threshold is not None]
    assert thresholds[0] == pytest.approx(0.7)
    assert thresholds[-1] > 0.7
    assert any(key.startswith("slo-feedback:") for key in result.reasons)


def test_policy_file_strategies_and_errors(tmp_path: Path) -> None:
    path = tmp_path / "policies.yaml"
    path.write_text("strict:\n  type: static\n  value: 0.95\n")
    (strategy,) = resolve_strategies(["strict"], load_policy_file(path))
    assert strategy.threshold is not None
    assert strategy.threshold.policy.model_dump(mode="json", exclude_unset=True) == {
        "type": "static",
        "value": 0.95,
    }
    path.write_text("broken:\n  type: static\n  value: 3\n")
    with pytest.raises(ValueError, match="policy 'broken'"):
        load_policy_file(path)
    with pytest.raises(ValueError, match="unknown strategy 'nope'"):
        resolve_strategies(["nope"])
    with pytest.raises(ValueError, match="named twice"):
        resolve_strategies(["static-0.5", "static-0.5"])


def _preempting_burst() -> RunResult:
    """Four warm prompts, then the same four with 400 tokens each at once on a tiny
    fleet with room for 2048 tokens: the decoder preempts some (static 0.9)."""
    warm_up = [(float(i), (Segment(50 + i, 400),), 4) for i in range(4)]
    burst = [(100.0 + 0.01 * i, (Segment(50 + i, 400),), 400) for i in range(4)]
    requests = tuple(
        BenchRequest(i, f"s{i}", 0, segments, max_tokens, arrival=at)
        for i, (at, segments, max_tokens) in enumerate(warm_up + burst)
    )
    fleet = replace(preset_fleet("tiny"), kv_capacity_tokens=2048)
    return _run("static-0.9", Workload("burst", "", requests), fleet)


def test_preempted_requests_are_handed_back_and_complete() -> None:
    result = _preempting_burst()
    later = result.records[4:]
    assert [r.decision for r in later] == ["decode"] * 4  # warm: admitted at 0.9
    assert result.preemptions > 0 and sum(r.handbacks for r in later) > 0
    assert all(r.ok and r.output_tokens == 400 for r in later)
    handed = [r for r in later if r.handbacks]
    assert all(r.prefiller == "h200-p0" and r.kv_bytes > 0 for r in handed)


def test_a_fleet_runs_once() -> None:
    (strategy,) = resolve_strategies(["static-0.5"])
    fleet = VirtualFleet(preset_fleet("tiny"), strategy, AFFINITY)
    fleet.run(COLD_THEN_WARM)
    with pytest.raises(RuntimeError, match="runs once"):
        fleet.run(COLD_THEN_WARM)


def test_a_flexible_fleet_decodes_on_its_prefillers_too() -> None:
    args = argparse.Namespace(fleet="tiny", decoders=None, prefillers=None, prefill_role="both")
    fleet = _fleet(args)
    assert fleet.name == "tiny-flex"
    assert [(i.name, i.role) for i in fleet.instances] == [
        ("h200-d0", Role.DECODE),
        ("h200-p0", Role.BOTH),
    ]
    prompts = [(0.01 * k, (Segment(100 + k, 2000),)) for k in range(8)]
    result = _run("goodput", _workload(*prompts), fleet)
    assert {r.decision for r in result.records} == {"decode"}  # idle: every prompt local
    assert {r.decoder for r in result.records} == {"h200-d0", "h200-p0"}


def test_a_spilling_fleet_serves_a_queued_decoder_s_prompts_whole_on_its_prefillers() -> None:
    args = argparse.Namespace(fleet="tiny", decoders=None, prefillers=None, prefill_role="spill")
    fleet = _fleet(args)
    assert fleet.name == "tiny-spill"
    assert [(i.name, i.role, i.spill) for i in fleet.instances] == [
        ("h200-d0", Role.DECODE, False),
        ("h200-p0", Role.PREFILL, True),
    ]
    assert not any(i.spill for i in fleet.aggregated().instances)
    burst = _workload(*((0.001 * k, (Segment(100 + k, 8000),)) for k in range(12)))
    spilled = _run("goodput", burst, fleet)
    assert all(r.ok for r in spilled.records)
    whole_on_p0 = [r for r in spilled.records if r.decoder == "h200-p0"]
    assert whole_on_p0 and {r.decision for r in whole_on_p0} == {"decode"}
    assert spilled.reasons["goodput:spill"] == len(whole_on_p0)
    # the same burst where the prefiller does not spill: every stream on the decoder
    split = _run("goodput", burst, preset_fleet("tiny"))
    assert {r.decoder for r in split.records} == {"h200-d0"}


@pytest.mark.parametrize("strategy", ["llm-d", "static-0.0"])
def test_every_strategy_spills_by_the_plain_rule_when_its_decoder_is_queued(strategy: str) -> None:
    args = argparse.Namespace(fleet="tiny", decoders=None, prefillers=None, prefill_role="spill")
    fleet = _fleet(args)
    # 200 short prompts (kept local by both rules) in 2 s queue on the one decoder
    burst = _workload(*((0.01 * k, (Segment(100 + k, 900),)) for k in range(200)))
    spilled = _run(strategy, burst, fleet)
    assert all(r.ok for r in spilled.records)
    whole_on_p0 = [r for r in spilled.records if r.decoder == "h200-p0"]
    assert whole_on_p0 and {r.decision for r in whole_on_p0} == {"decode"}
    assert {r.prefiller for r in whole_on_p0} == {None}  # served whole, no P/D leg
    assert spilled.reasons["plain-spill:queued"] == len(whole_on_p0)
    # the same burst on the split fleet: every request on the decoder
    split = _run(strategy, burst, preset_fleet("tiny"))
    assert {r.decoder for r in split.records} == {"h200-d0"}
    assert not any(k.startswith("plain-spill") for k in split.reasons)


def test_goodput_spills_by_its_own_rule_not_the_plain_one() -> None:
    args = argparse.Namespace(fleet="tiny", decoders=None, prefillers=None, prefill_role="spill")
    burst = _workload(*((0.01 * k, (Segment(100 + k, 900),)) for k in range(200)))
    result = _run("goodput", burst, _fleet(args))
    assert result.reasons["goodput:spill"] > 0
    assert not any(k.startswith("plain-spill") for k in result.reasons)


@pytest.mark.parametrize("indexed", [True, False], ids=["prefix-index", "no-index"])
def test_the_policy_sees_the_decoder_s_cached_prefix_as_a_precise_index_would(
    indexed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[int | None] = []
    decide = GoodputPolicy.decide

    def spy(self: GoodputPolicy, context: ThresholdContext) -> Route:
        seen.append(context.cached_tokens)
        return decide(self, context)

    monkeypatch.setattr(GoodputPolicy, "decide", spy)
    (goodput,) = resolve_strategies(["goodput"])
    fleet = VirtualFleet(
        preset_fleet("tiny"), goodput, AFFINITY, VirtualOptions(prefix_index=indexed)
    )
    result = fleet.run(COLD_THEN_WARM)
    assert all(r.ok for r in result.records)
    # cold: nothing held; warm: the document's full blocks, on the decoder that
    # decoded it the first time
    assert seen == ([0, 1984] if indexed else [None, None])


def test_a_prompt_in_flight_counts_as_held_where_it_was_sent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The second of two copies of a document arrives before the first has its first
    output: the decoder the routing sends it to holds the document pending (the
    gateway's pending blocks), though its cache holds nothing yet."""
    seen: list[tuple[str, int | None]] = []
    decide = GoodputPolicy.decide

    def spy(self: GoodputPolicy, context: ThresholdContext) -> Route:
        seen.append((context.decoder.endpoint.name, context.cached_tokens))
        return decide(self, context)

    monkeypatch.setattr(GoodputPolicy, "decide", spy)
    (goodput,) = resolve_strategies(["goodput"])
    fleet = VirtualFleet(preset_fleet("tiny"), goodput, AFFINITY)
    result = fleet.run(_workload((0.0, DOC), (0.0005, DOC)))
    assert all(r.ok for r in result.records)
    (first, cold), (second, pending) = seen
    assert first == second  # affinity: the same decoder
    assert (cold, pending) == (0, 1984)


class _Recording(FlowMachine):
    """The gateway's flow machine, keeping every instance made (one per request)."""

    made: ClassVar[list[_Recording]] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.steps: list[object] = []
        _Recording.made.append(self)

    def attempted(self, *args: Any, **kwargs: Any) -> Serve | ThroughPD | Alone:
        step = super().attempted(*args, **kwargs)
        self.steps.append(step)
        return step

    def leg_ended(self, *args: Any, **kwargs: Any) -> Step:
        step = super().leg_ended(*args, **kwargs)
        self.steps.append(step)
        return step


def test_the_bench_s_requests_take_the_flow_machine_s_decisions(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _Recording.made = []
    monkeypatch.setattr(virtual, "FlowMachine", _Recording)
    result = _preempting_burst()
    machines = _Recording.made
    assert len(machines) == len(result.records)
    for record, machine in zip(result.records, machines, strict=True):
        assert record.decision == machine.decision
        assert record.handbacks == machine.handbacks
        assert isinstance(machine.steps[0], Serve | ThroughPD)  # the attempt, first
        assert machine.steps[-1] == Done()  # and the answer's end, last
    handed = [m for m in machines if m.handbacks]
    assert handed  # each hand-back is the machine's: P/D at the leg threshold (0 here)
    assert all(m.steps[1 : 1 + m.handbacks] == [ThroughPD(m.decoder, 0.0)] * m.handbacks
               for m in handed)  # fmt: skip


def test_with_no_prefiller_to_hand_over_to_the_decoder_serves_alone_as_the_gateway_does() -> None:
    tiny = preset_fleet("tiny")
    alone = replace(tiny, instances=tuple(i for i in tiny.instances if i.role.decodes))
    result = _run("static-0.5", COLD_THEN_WARM, alone)
    assert all(r.ok and r.decision == "decode" and r.prefiller is None for r in result.records)
    assert result.records[0].kv_bytes == 0


@pytest.mark.parametrize("scale", [0.0, 3.0])
def test_goodput_is_held_to_the_slo_the_bench_judges_it_by(scale: float) -> None:
    slo = Slo(1.0, 0.03, scale, get_profile("h200-llama3-8b"))
    (goodput,) = resolve_strategies(["goodput"], {}, slo)
    assert goodput.threshold is not None
    params = goodput.threshold.policy.params
    assert (params["ttft"], params["tpot"], params["ttft_scale"]) == (1.0, 0.03, scale)
