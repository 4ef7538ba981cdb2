"""``--profile-error``: a wrong belief given to ``goodput`` (never to the simulated
truth), and the attainment per window of arrivals."""

from __future__ import annotations

import pytest

from pd_orchestrator.bench.belief import (
    ProfileError,
    attainment_windows,
    misjudges,
    windows_rows,
)
from pd_orchestrator.bench.fleet import preset_fleet
from pd_orchestrator.bench.results import RequestRecord, RunResult, Slo
from pd_orchestrator.bench.strategies import resolve_strategies
from pd_orchestrator.bench.virtual import VirtualFleet, VirtualOptions
from pd_orchestrator.cli.bench import ROUTING_PRESETS
from pd_orchestrator.model.hardware import get_profile
from pd_orchestrator.policies.base import LatencyObservation
from pd_orchestrator.policies.goodput import GoodputParams, GoodputPolicy
from pd_orchestrator.policies.goodput_model import PoolModel
from pd_orchestrator.policies.plugins import builtin_registry
from pd_orchestrator.routing import RoutingConfig, build_profiles

ROUTING = build_profiles(RoutingConfig.model_validate(ROUTING_PRESETS["load"]), builtin_registry())


def _fleet_policy(error: ProfileError | None) -> tuple[VirtualFleet, GoodputPolicy]:
    (strategy,) = resolve_strategies(["goodput"])
    fleet = VirtualFleet(
        preset_fleet("tiny"), strategy, ROUTING, VirtualOptions(profile_error=error)
    )
    resolver = fleet.planner.threshold
    assert resolver is not None and isinstance(resolver.policy, GoodputPolicy)
    return fleet, resolver.policy


def _pool(fleet: VirtualFleet, policy: GoodputPolicy) -> PoolModel:
    (decoder,) = fleet.decoders
    return policy.model.pool(decoder.endpoint)


def test_parse_reads_either_factor_and_rejects_the_rest() -> None:
    assert ProfileError.parse("prefill=2") == ProfileError(prefill=2.0)
    assert ProfileError.parse(" transfer=5 , prefill=0.5") == ProfileError(0.5, 5.0)
    assert ProfileError.parse("prefill=2,transfer=5").describe() == "prefill x2, transfer x5"
    assert ProfileError().describe() == "right"
    for bad in ("decode=2", "prefill", "prefill=fast", "prefill=0", "transfer=-1", "prefill=nan"):
        with pytest.raises(ValueError):
            ProfileError.parse(bad)


def test_a_prefill_error_multiplies_the_seeded_rates_and_divides_the_attention() -> None:
    right_fleet, right = _fleet_policy(None)
    wrong_fleet, wrong = _fleet_policy(ProfileError(prefill=2.0))
    truth, belief = _pool(right_fleet, right), _pool(wrong_fleet, wrong)
    assert truth.rate_local == pytest.approx(1.0 / get_profile("h200-llama3-8b").lin)
    assert belief.rate_local == pytest.approx(2 * truth.rate_local)
    assert belief.rate_remote == pytest.approx(2 * truth.rate_remote)
    assert belief.seed == pytest.approx(2 * truth.seed)
    assert belief.attn == pytest.approx(truth.attn / 2) and truth.attn > 0
    # every prefill looks twice as fast; the transfer belief is untouched
    assert belief.prefill_seconds(belief.rate_local, 4096, 1024) == pytest.approx(
        truth.prefill_seconds(truth.rate_local, 4096, 1024) / 2
    )
    assert wrong.params.transfer_tokens_per_s == right.params.transfer_tokens_per_s
    # the simulated truth is the same engine profile either way
    assert [i.profile for i in wrong_fleet.instances] == [i.profile for i in right_fleet.instances]


def test_a_transfer_error_multiplies_the_believed_link_rate_only() -> None:
    right_fleet, right = _fleet_policy(None)
    wrong_fleet, wrong = _fleet_policy(ProfileError(transfer=5.0))
    truth, belief = _pool(right_fleet, right), _pool(wrong_fleet, wrong)
    assert belief.handover.slope == pytest.approx(truth.handover.slope / 5)
    assert belief.handover.fixed == truth.handover.fixed
    assert belief.rate_local == truth.rate_local
    # a link rate set in the parameters is the one multiplied
    params = GoodputParams(transfer_tokens_per_s=100_000.0)
    policy = GoodputPolicy(params)
    ProfileError(transfer=5.0).apply(policy, [d.endpoint for d in right_fleet.decoders])
    assert policy.params.transfer_tokens_per_s == pytest.approx(500_000.0)
    assert policy.model.params is policy.params


def test_only_strategies_with_a_goodput_policy_are_misjudged() -> None:
    goodput, dynamo, decode_only = resolve_strategies(["goodput", "dynamo", "decode-only"])
    assert misjudges(goodput)
    assert not misjudges(dynamo) and not misjudges(decode_only)
    resolver = dynamo.resolver()
    assert resolver is not None and ProfileError(prefill=2).apply(resolver.policy, []) == 0


def _record(index: int, arrival: float, ttft: float | None) -> RequestRecord:
    record = RequestRecord(index, f"s{index}", arrival, 100)
    if ttft is not None:
        record.ttft, record.e2e, record.tpot = ttft, ttft + 1.0, 0.01
    return record


def test_attainment_windows_split_requests_by_arrival() -> None:
    slo = Slo(ttft=1.0, tpot=0.05)
    records = [
        _record(0, 10.0, 0.5),
        _record(1, 30.0, 2.0),  # too slow
        _record(2, 69.0, 0.2),
        _record(3, 75.0, None),  # failed
        _record(4, 200.0, 0.1),
    ]
    result = RunResult("goodput", "decode-first", "test", "tiny", "virtual", records)
    windows = attainment_windows(result, slo, 60.0)
    assert [(w.start, w.requests, w.attainment) for w in windows] == [
        (10.0, 3, pytest.approx(2 / 3)),
        (70.0, 1, 0.0),
        (190.0, 1, 1.0),
    ]
    assert windows_rows([result], slo, 60.0)[0] == ["10-70s", "66.7% (3)"]
    with pytest.raises(ValueError):
        attainment_windows(result, slo, 0.0)


def _served(policy: GoodputPolicy, pool: str, ttft: float, tokens: int, *, remote: bool) -> None:
    cached = None if remote else 0
    policy.observe(
        LatencyObservation(
            "m", pool, 0.0, ttft=ttft, prompt_tokens=tokens, cached_tokens=cached, remote=remote
        )
    )


def test_prefill_rates_twice_too_optimistic_fall_to_the_truth_within_a_few_dozen_samples() -> None:
    """A rate moves down by at most ``alpha * (1 - 1/1.5)`` a sample while it is more
    than 1.5 times the sample, then by ``alpha`` of the gap: from x2, 80 cold prompts
    served at the engine's speed bring both rates within 5% of it."""
    right_fleet, right = _fleet_policy(None)
    wrong_fleet, wrong = _fleet_policy(ProfileError(prefill=2.0))
    truth, belief = _pool(right_fleet, right), _pool(wrong_fleet, wrong)
    (decoder,) = wrong_fleet.decoders
    tokens, hop = 4096, wrong.params.hop
    local = truth.prefill_seconds(truth.rate_local, tokens, 0) + 2 * hop
    remote = local - 2 * hop + wrong.model.handover(belief, tokens) + 4 * hop
    for _ in range(80):
        _served(wrong, decoder.endpoint.pool, local, tokens, remote=False)
        _served(wrong, decoder.endpoint.pool, remote, tokens, remote=True)
    # what the wrong belief predicts for the prompt, against what it took
    predicted = belief.prefill_seconds(belief.rate_local, tokens, 0)
    assert predicted == pytest.approx(local - 2 * hop, rel=0.05)
    assert belief.prefill_seconds(belief.rate_remote, tokens, 0) == pytest.approx(
        local - 2 * hop, rel=0.05
    )


def test_a_link_five_times_slower_than_believed_is_absorbed_by_the_learnt_remote_rate() -> None:
    """A P/D sample without the prefill answer's time: its prefill is its TTFT less
    the believed hand-over, so a slower link shows as a slower remote rate, and the
    remote path's estimate (prefill plus believed hand-over) comes to what it took."""
    right_fleet, right = _fleet_policy(None)
    wrong_fleet, wrong = _fleet_policy(ProfileError(transfer=5.0))
    truth = _pool(right_fleet, right)
    belief = _pool(wrong_fleet, wrong)
    (decoder,) = wrong_fleet.decoders
    tokens, hop = 8192, wrong.params.hop
    link, believed = right.model.handover(truth, tokens), wrong.model.handover(belief, tokens)
    took = truth.prefill_seconds(truth.rate_remote, tokens, 0) + link + 4 * hop
    before = belief.prefill_seconds(belief.rate_remote, tokens, 0) + believed
    assert took - 4 * hop - before == pytest.approx(link - believed)  # missed at first
    assert believed < link
    for _ in range(80):
        _served(wrong, decoder.endpoint.pool, took, tokens, remote=True)
    after = belief.prefill_seconds(belief.rate_remote, tokens, 0) + believed
    assert after == pytest.approx(took - 4 * hop, rel=0.01)
