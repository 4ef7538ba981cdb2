"""The ``goodput`` cost model: its estimates against hand-computed cases, the
decisions it flips, and what it learns."""

from __future__ import annotations

import logging
import math
import random
import statistics
from collections.abc import Callable
from dataclasses import replace

import pytest

from pd_orchestrator.fleet.cache_reports import CacheReports
from pd_orchestrator.flows.request import ClientRequest
from pd_orchestrator.flows.transcript import Transcript
from pd_orchestrator.model.endpoints import Endpoint, Role
from pd_orchestrator.model.load import Candidate, LoadSnapshot
from pd_orchestrator.model.measured import knowledge_for
from pd_orchestrator.model.route import Ask, Decline, GoPD, Local, Route, Whole, threshold_of
from pd_orchestrator.openai.protocol import CompletionRequest, parse_request
from pd_orchestrator.policies import LatencyObservation, ThresholdContext
from pd_orchestrator.policies.base import ContextReads
from pd_orchestrator.policies.goodput import GoodputPolicy
from pd_orchestrator.policies.goodput_model import (
    DutyCycle,
    GoodputParams,
    PoolModel,
    profile_of,
    seed_rate,
)
from pd_orchestrator.policies.octave_line import OctaveLine
from tests.policies.helpers import build, context, decoder, load, prefiller

RATE = 10_000.0  # tokens/s, local and remote
PARAMS = GoodputParams(
    ttft=1.0, tpot=0.03, slack=0.8, transfer_tokens_per_s=100_000.0, hop=0.0, tpot_goal=0.5
)

H200 = knowledge_for("h200-llama3-8b")
"""The simulator's H200 profile, known as a simulated endpoint's."""


def _known_h200() -> Endpoint:
    """A decoder known to run the simulator's H200 profile."""
    return Endpoint(
        "d", "http://d:1", Role.DECODE, "h200", model="meta-llama/Llama-3.1-8B-Instruct",
        knowledge=H200,
    )  # fmt: skip


def _policy(**params: float) -> GoodputPolicy:
    policy = GoodputPolicy(PARAMS.model_copy(update=params))
    policy.model.pools["decode"] = PoolModel(RATE, RATE, itl=0.01, free_tokens=0.0)
    return policy


def _decided(policy: GoodputPolicy, context: ThresholdContext) -> Route:
    """The policy's route, and the policy told it was taken (as the planner does)."""
    route = policy.decide(context)
    policy.chosen(context, route)
    return route


def _wait(policy: GoodputPolicy, context: ThresholdContext, pool: PoolModel) -> float:
    """The decoder's queue at its hit rate (its reading's, remembered)."""
    model = policy.model
    model.saw((context.decoder,))
    hit = model.hit_rate(context.decoder) or 0.0
    return model.queued(context.decoder, context.prompt_tokens, pool, hit)


def _named(route: Route) -> str | None:
    """The endpoint a route names: a drain's peer, a spill's prefiller."""
    match route:
        case GoPD(peer=peer):
            return peer
        case Whole(prefiller=name):
            return name
        case _:
            return None


class _Held:
    """Reads of ``context`` with the cache counts of ``held`` (by endpoint)."""

    def __init__(self, reads: ContextReads, held: Callable[[Endpoint], int | None]) -> None:
        self.reads, self.held = reads, held

    def prefillers(self) -> tuple[Candidate, ...]:
        return self.reads.prefillers()

    def peers(self) -> tuple[Candidate, ...]:
        return self.reads.peers()

    def cached_tokens(self, endpoint: Endpoint) -> int | None:
        return self.held(endpoint)


def _holding(context: ThresholdContext, held: Callable[[Endpoint], int | None]) -> ThresholdContext:
    return replace(context, reads=_Held(context.reads, held))


def _admits(threshold: float, tokens: int, uncached: int) -> bool:
    return (tokens - uncached) / tokens >= threshold


def test_remote_ttft_is_the_best_prefiller_s_wait_prefill_and_transfer() -> None:
    policy = _policy()
    busy = prefiller("p0", in_flight=3)
    idle = prefiller("p1", reading=load(running=1))
    ctx = context(tokens=20_000, prefillers=(busy, idle))
    # p1: 1 request of the 20k mean ahead (2 s), 20k tokens (2 s), transfer 0.2 s
    assert policy.model.remote_ttft(ctx, policy.model.pools["decode"]) == pytest.approx(
        2.0 + 2.0 + 0.2
    )
    assert policy.model.remote_ttft(context(prefillers=()), policy.model.pools["decode"]) is None
    # the gateway's backlog in tokens beats a count times the mean, and a prefiller's
    # prefix-cache hit rate takes its share off both
    queued = prefiller("p2", in_flight=1, backlog=50_000)
    assert policy.model.remote_ttft(
        context(tokens=20_000, prefillers=(queued,)), policy.model.pools["decode"]
    ) == pytest.approx(5.0 + 2.0 + 0.2)
    warm = prefiller("p3", reading=LoadSnapshot(1, 0, 0.0, 0.0, prefix_hit_rate=0.75))
    assert policy.model.remote_ttft(
        context(tokens=20_000, prefillers=(warm,)), policy.model.pools["decode"]
    ) == pytest.approx((20_000 + 20_000) * 0.25 / RATE + 0.2)


def test_a_p_d_route_names_the_prefiller_its_remote_estimate_assumed() -> None:
    policy = _policy()
    policy.model.out_mean = policy.model.out_low = 10  # 1000 tokens of room beside streams
    busy = decoder(in_flight=30)
    queued = prefiller("p0", in_flight=1, backlog=2_000)
    idle = prefiller("p1", reading=load())
    route = _decided(policy, context(tokens=6_000, dec=busy, prefillers=(queued, idle)))
    assert route.reason == "stall" and isinstance(route, Ask)
    assert route.prefiller == "p1"  # not the snapshot's first, 0.2 s of backlog there
    # every prefiller as soon: none named, the prefill ranking picks
    even = (prefiller("p0", reading=load()), idle)
    route = _decided(policy, context(tokens=6_000, dec=busy, prefillers=even))
    assert route.reason == "stall" and isinstance(route, Ask) and route.prefiller is None
    # the soonest serves streams too (its pool spills): the ranking, which counts them
    spilling = replace(idle, endpoint=replace(idle.endpoint, spill=True))
    route = _decided(policy, context(tokens=6_000, dec=busy, prefillers=(queued, spilling)))
    assert isinstance(route, Ask) and route.prefiller is None


def test_the_prefix_index_s_count_on_a_prefiller_replaces_its_hit_rate_for_the_prompt() -> None:
    policy = _policy()
    # its last reading says nearly everything hit (a window of re-asked documents)
    warm = prefiller("p0", reading=LoadSnapshot(0, 0, 0.0, 0.0, prefix_hit_rate=0.99))
    model = policy.model.pools["decode"]
    by_rate = context(tokens=20_000, prefillers=(warm,))
    assert policy.model.remote_ttft(by_rate, model) == pytest.approx(20_000 * 0.01 / RATE + 0.2)
    # the index says it holds none of this prompt: the whole prompt is prefilled there
    cold = _holding(by_rate, lambda endpoint: 0)
    assert policy.model.remote_ttft(cold, model) == pytest.approx(2.0 + 0.2)
    # and 15,000 of its tokens: the other 5,000; the queue keeps the hit rate's share
    queued = replace(warm, backlog=10_000)
    held = context(tokens=20_000, prefillers=(queued,))
    held = _holding(held, lambda endpoint: 15_000)
    assert policy.model.remote_ttft(held, model) == pytest.approx((100 + 5_000) / RATE + 0.2)


def test_local_wait_counts_the_uncached_work_queued_at_the_decoder() -> None:
    policy = _policy()
    policy.model.prompt_mean = 4000
    reading = load(running=2, waiting=3)
    reading = type(reading)(2, 3, 0.0, 0.0, prefix_hit_rate=0.5)
    ctx = context(tokens=4000, dec=decoder(reading=reading))
    assert _wait(policy, ctx, policy.model.pools["decode"]) == pytest.approx(3 * 2000 / RATE)
    # the five requests there are the gateway's: the prompts it sent there that had no
    # first token yet, exact; the mean stands in for none of them
    ctx = context(tokens=4000, dec=decoder(reading=reading, in_flight=5, backlog=30_000))
    assert _wait(policy, ctx, policy.model.pools["decode"]) == pytest.approx(15_000 / RATE)
    # three of them: the mean for the two queued that another client sent
    ctx = context(tokens=4000, dec=decoder(reading=reading, in_flight=3, backlog=30_000))
    assert _wait(policy, ctx, policy.model.pools["decode"]) == pytest.approx(19_000 / RATE)
    # a reading without a hit rate (a window with no prompt, a missed scrape): the last
    # one read stands
    assert _wait(
        policy, context(dec=decoder(backlog=30_000)), policy.model.pools["decode"]
    ) == pytest.approx(1.5)
    assert _wait(
        _policy(), context(dec=decoder(backlog=30_000)), policy.model.pools["decode"]
    ) == pytest.approx(3.0)  # no reading ever: no hit rate to take off


def test_the_stall_limit_is_what_is_left_of_the_prefill_share_the_tpot_goal_allows() -> None:
    policy = _policy()
    policy.model.out_mean = 100  # a stream decodes for 100 * 0.03 = 3 s: the window
    policy.model.out_low = 100  # no short stream: the mean bound binds
    model = policy.model.pools["decode"]
    assert policy.model.stall_limit(context(dec=decoder()), model) == math.inf  # nothing decodes
    busy = context(dec=decoder(in_flight=8))
    # no share yet: a 10 ms step may stretch to 0.5 * 30 ms, so prefill may take a
    # third of the decoder's time: a third of 3 s at 10k tokens/s
    assert policy.model.stall_limit(busy, model) == pytest.approx(10_000.0)
    policy.model.duty["d0"] = DutyCycle(6_000.0, 0.0)  # a fifth of the window's tokens
    # the bare step is 10 ms * 0.8; the allowed share 1 - 8/15; less the fifth used
    left = (1 - 0.008 / 0.015 - 0.2) * 3 * RATE
    assert policy.model.stall_limit(busy, model) == pytest.approx(left)
    model.itl = 0.05  # over the target already: only what a step carries for free
    model.free_tokens = 150.0
    assert policy.model.stall_limit(busy, model) == 150.0


def test_the_duty_cycle_decays_over_the_window() -> None:
    duty = DutyCycle()
    duty.add(10.0, 1_000.0, 2.0)
    assert duty.decayed(12.0, 2.0) == pytest.approx(1_000.0 / math.e)
    assert duty.decayed(9.0, 2.0) == 1_000.0  # a clock that went back decays nothing
    duty.add(12.0, 500.0, 2.0)
    assert duty.decayed(12.0, 2.0) == pytest.approx(1_000.0 / math.e + 500.0)


def test_a_busy_decoder_keeps_prompts_until_its_share_is_spent_then_they_go_p_d() -> None:
    policy = _policy()
    policy.model.out_mean = 100  # window 3 s; 10 000 tokens of room with no share
    policy.model.out_low = 100  # no short stream: the mean bound binds
    busy = decoder(in_flight=8)
    kept = []
    for _ in range(10):  # 2900 uncached tokens each, all at t = 0
        kept.append(_decided(policy, context(tokens=2_900, dec=busy)).reason)
    # with a share s the room is 10 000 * (1 - s), s = 2900 k / 30 000 after k kept
    # prompts: 8 fit, the 9th does not (room 2267)
    assert kept == ["local"] * 8 + ["stall"] * 2
    share = policy.model.local_share(busy, 0.0, policy.model.pools["decode"])
    assert share == pytest.approx(8 * 2_900 / 30_000)
    # a window later the share has decayed by e and prompts stay local again
    later = _decided(policy, context(tokens=2_900, dec=busy, now=3.0))
    assert later.reason == "local"
    # an idle decoder keeps everything, whatever another decoder's share
    assert _decided(policy, context(tokens=2_900, dec=decoder("d1"))).reason == "local"


def test_an_idle_prefill_pool_takes_what_would_stall_a_saturated_one_leaves_it_local() -> None:
    policy = _policy()
    policy.model.out_mean = 10  # window 0.3 s: 1000 tokens of room
    policy.model.out_low = 10  # no short stream: the mean bound binds
    busy_decoder = decoder(in_flight=30)
    idle = context(tokens=6_000, dec=busy_decoder, prefillers=(prefiller(reading=load()),))
    decision = _decided(policy, idle)  # remote 0.66 s, within 0.8 s: a sure alternative
    assert decision.reason == "stall"
    assert threshold_of(decision) == pytest.approx(1 - 1000.5 / 6000)
    queue = (prefiller(reading=load(running=1, waiting=40)),)
    saturated = _decided(policy, context(tokens=6_000, dec=busy_decoder, prefillers=queue))
    assert threshold_of(saturated) == 0.0 and saturated.reason == "local"  # remote: 25 s
    # remote 0.88 s meets the 1 s TTFT target (past its slack share): a sure alternative
    within = context(tokens=8_000, dec=busy_decoder, prefillers=(prefiller(reading=load()),))
    assert _decided(policy, within).reason == "stall"
    # remote 1.045 s misses it, and the local prefill (0.95 s) meets it: not sure enough
    unsure = context(tokens=9_500, dec=busy_decoder, prefillers=(prefiller(reading=load()),))
    assert _decided(policy, unsure).reason == "local"
    # a spilling prefiller's prefills stall the streams it serves whole: 0.88 s is past
    # the target's slack share (0.8 s) there, not sure enough
    spill = (prefiller(reading=load(), spill=True),)
    beside = context(tokens=8_000, dec=busy_decoder, prefillers=spill)
    assert _decided(policy, beside).reason == "local"
    # a prefiller that also decodes would take the stall to its own streams
    flexible = (prefiller(reading=load(), role=Role.BOTH),)
    moved = _decided(policy, context(tokens=6_000, dec=busy_decoder, prefillers=flexible))
    assert threshold_of(moved) == 0.0 and moved.reason == "local"


def test_a_prompt_lost_on_either_path_goes_where_it_stalls_no_stream() -> None:
    """With the prefill pool too late for the target, a busy decoder keeps a prompt it
    prefills in time (above), but not one whose local prefill misses the target too:
    keeping that one would save nothing and stall every stream beside it."""

    def decided(tokens: int, dec: Candidate) -> Route:
        policy = _policy()
        policy.model.out_mean = 10  # window 0.3 s: 1000 tokens of room
        policy.model.out_low = 10  # no short stream: the mean bound binds
        queue = (prefiller(reading=load(running=1, waiting=40)),)  # remote: about 25 s
        return _decided(policy, context(tokens=tokens, dec=dec, prefillers=queue))

    busy = decoder(in_flight=30)
    in_time = decided(9_000, busy)  # 0.9 s local, within the 1 s target
    assert threshold_of(in_time) == 0.0 and in_time.reason == "local"
    late = decided(12_000, busy)  # 1.2 s local, past it
    assert late.reason == "stall"
    assert threshold_of(late) == pytest.approx(1 - 1000.5 / 12_000)
    # an idle decoder has no stream to stall: it keeps the late prompt
    alone = decided(12_000, decoder())
    assert threshold_of(alone) == 0.0 and alone.reason == "local"


def test_a_long_prompt_that_misses_either_way_stays_where_it_is_cheaper() -> None:
    policy = _policy()
    decision = _decided(policy, context(tokens=30_000, prefillers=(prefiller(reading=load()),)))
    assert threshold_of(decision) == 0.0  # local 3 s, remote 3.3 s: no transfer for nothing


def test_an_idle_decoder_keeps_what_meets_the_target_a_queued_one_drains() -> None:
    policy = _policy()
    prefillers = (prefiller(reading=load()),)
    idle = _decided(policy, context(tokens=5_000, prefillers=prefillers))
    assert threshold_of(idle) == 0.0 and idle.reason == "local"  # 0.5 s locally
    queued = decoder(backlog=20_000)  # 2 s of prefill ahead: past its 0.8 s share
    decision = _decided(policy, context(tokens=5_000, dec=queued, prefillers=prefillers))
    assert decision.reason == "drain" and threshold_of(decision) == 1.0  # P/D, no attempt


def test_a_queued_decoder_drains_only_to_a_path_that_meets_the_target() -> None:
    slow = (prefiller(backlog=30_000, reading=load()),)  # remote 3.5 s + 0.05 s transfer
    # wait 0.9 s (past the 0.8 s share) + 500 tokens 0.05 s: local may still meet 1 s
    read = LoadSnapshot(0, 0, 0.0, 0.0, prefix_hit_rate=0.0)
    near = decoder(backlog=9_000, reading=read)
    decision = _policy().decide(context(tokens=500, dec=near, prefillers=slow))
    assert decision.reason == "queued" and threshold_of(decision) == 0.0
    # wait 2 s + 0.5 s: lost locally, but the remote path (3.55 s) is lost too, and a
    # drain would only move the miss onto a prefiller whose other work then waits
    far = decoder(backlog=20_000, reading=read)
    assert _policy().decide(context(tokens=5_000, dec=far, prefillers=slow)).reason == "queued"
    # a prefiller with 4,000 tokens queued answers in 0.95 s: the drain meets the target
    near_prefiller = (prefiller(backlog=4_000, reading=load()),)
    moved = _policy().decide(context(tokens=5_000, dec=far, prefillers=near_prefiller))
    assert moved.reason == "drain" and threshold_of(moved) == 1.0
    # the same queue with no hit rate ever read: 2 s is only an upper bound, and the
    # remote path (3.55 s) is no faster, so it stays
    unread = decoder(backlog=20_000)
    assert _policy().decide(context(tokens=5_000, dec=unread, prefillers=slow)).reason == "queued"
    # an idle prefiller (0.55 s) is faster than the 2.5 s the queue promises, but only
    # a remote path within the 0.8 s share is sure enough against an unread wait
    idle = (prefiller(reading=load()),)
    assert _policy().decide(context(tokens=5_000, dec=unread, prefillers=idle)).reason == "drain"
    assert _policy().decide(context(tokens=9_000, dec=unread, prefillers=idle)).reason == "queued"
    read_rate = decoder(backlog=20_000, reading=read)  # 0.95 s remote, 2.9 s local
    assert _policy().decide(context(tokens=9_000, dec=read_rate, prefillers=idle)).reason == "drain"


def test_the_prefix_index_s_count_of_the_prompt_replaces_the_unread_upper_bound() -> None:
    idle = (prefiller(reading=load()),)  # remote 0.5 s + 0.05 s transfer
    unread = decoder(backlog=20_000)  # no reading: 2 s of prefill, an upper bound
    policy = _policy()
    assert _decided(policy, context(tokens=5_000, dec=unread, prefillers=idle)).reason == "drain"
    # the index says the decoder holds 90% of the prompt: the queue is taken to be as
    # cached (0.2 s), and the 500 uncached tokens (0.05 s) stay local, all of them
    held = _decided(policy, context(tokens=5_000, dec=unread, prefillers=idle, cached=4_500))
    assert held.reason == "local" and threshold_of(held) == 0.0
    assert policy.model.duty[unread.endpoint.name].tokens == pytest.approx(500)
    # the index says nothing is held: no longer an upper bound but a count, so a
    # remote path faster than the 2.9 s local one drains even past the 0.8 s share
    assert _policy().decide(context(tokens=9_000, dec=unread, prefillers=idle)).reason == "queued"
    cold = _policy().decide(context(tokens=9_000, dec=unread, prefillers=idle, cached=0))
    assert cold.reason == "drain"


def test_a_read_hit_rate_still_sets_the_queue_the_index_only_this_prompt() -> None:
    idle = (prefiller(reading=load()),)
    read = decoder(backlog=20_000, reading=LoadSnapshot(0, 0, 0.0, 0.0, prefix_hit_rate=0.0))
    # the reading says the queue is uncached (2 s): the prompt's own 90% does not
    # shrink it, so the request drains
    decision = _policy().decide(context(tokens=5_000, dec=read, prefillers=idle, cached=4_500))
    assert decision.reason == "drain"


def test_a_drained_request_decodes_on_the_peer_where_it_starts_soonest() -> None:
    queued = decoder(backlog=20_000)  # 2 s of prefill ahead: it drains
    behind = decoder("d1", backlog=5_000)  # 0.5 s
    waiting = decoder("d2", reading=load(waiting=1))  # one prompt's worth: 0.5 s
    idle, idler = decoder("d3", in_flight=3), decoder("d4", in_flight=1)
    policy = _policy()
    peers = (behind, waiting, idle, idler)
    decision = _decided(policy, context(tokens=5_000, dec=queued, peers=peers))
    assert decision.reason == "drain" and _named(decision) == "d4"  # no queue, fewest streams
    assert policy.soonest(context(tokens=5_000, dec=queued, peers=peers[:3]), 2.0) == "d3"
    assert (
        policy.soonest(context(tokens=5_000, dec=queued, peers=peers[:2]), 2.0) == "d1"
    )  # ranking order
    # a peer's cached share of its queue is not queued prefill: 20k at 90% hit is 0.2 s
    warm = decoder("d5", backlog=20_000, reading=LoadSnapshot(0, 0, 0.0, 0.0, prefix_hit_rate=0.9))
    assert policy.soonest(context(tokens=5_000, dec=queued, peers=(behind, warm)), 2.0) == "d5"
    # no peer starts it sooner: the chosen decoder decodes it
    deeper = decoder("d6", backlog=30_000)
    decision = _decided(policy, context(tokens=5_000, dec=queued, peers=(deeper,)))
    assert decision.reason == "drain" and _named(decision) is None
    # a decision that keeps the prompt, or sends it through a decode attempt, names none
    assert _named(_decided(policy, context(tokens=5_000, peers=peers))) is None


def test_a_drained_request_skips_a_crowded_peer_however_short_its_queue() -> None:
    """A decode leg adds a stream and no prefill to its peer: without the step test the
    peer with the least queued takes every drained leg (165 of 186 on one decoder, 107
    of them past their TPOT, on a warm shared-prefix burst)."""
    queued = decoder(backlog=20_000)  # 2 s of prefill ahead: it drains
    crowded = decoder("d1", pool="slow", in_flight=1)  # no queue; its step is 20 ms
    behind = decoder("d2", backlog=5_000)  # 0.5 s of prefill; a 10 ms step
    policy = _policy()
    policy.model.pools["slow"] = PoolModel(RATE, RATE, itl=0.02, free_tokens=0.0)
    decision = _decided(policy, context(tokens=5_000, dec=queued, peers=(crowded, behind)))
    assert decision.reason == "drain" and _named(decision) == "d2"
    # the step bound is tpot * tpot_goal (15 ms here): at 12 ms the idle peer takes it
    policy.model.pools["slow"] = PoolModel(RATE, RATE, itl=0.012, free_tokens=0.0)
    assert policy.soonest(context(tokens=5_000, dec=queued, peers=(crowded, behind)), 2.0) == "d1"
    # every peer crowded: the chosen decoder decodes it
    policy.model.pools["slow"] = PoolModel(RATE, RATE, itl=0.02, free_tokens=0.0)
    assert policy.soonest(context(tokens=5_000, dec=queued, peers=(crowded,)), 2.0) is None


def test_a_queued_decoder_stays_local_when_every_prefiller_also_decodes() -> None:
    policy = _policy()
    policy.model.out_mean = 100
    flexible = (prefiller(reading=load(), role=Role.BOTH),)
    queued = decoder(backlog=20_000)
    decision = _decided(policy, context(tokens=5_000, dec=queued, prefillers=flexible))
    assert decision.reason == "queued" and threshold_of(decision) == 0.0
    assert policy.model.duty[queued.endpoint.name].tokens == pytest.approx(5_000)  # counted as kept
    # one dedicated prefiller among them is enough to drain to
    mixed = (*flexible, prefiller("p1", reading=load()))
    assert _decided(policy, context(tokens=5_000, dec=queued, prefillers=mixed)).reason == "drain"


def test_with_prefillers_that_also_decode_only_a_remote_path_that_meets_the_target_wins() -> None:
    policy = _policy()
    policy.model.pools["decode"] = PoolModel(RATE / 2, RATE, itl=0.01, free_tokens=0.0)  # 5000/s
    idle, flexible = prefiller(reading=load()), prefiller(reading=load(), role=Role.BOTH)
    # 4500 tokens: local 0.9 s, past the 0.8 s slack share; remote 0.495 s
    moved = _decided(policy, context(tokens=4_500, prefillers=(idle,)))
    assert moved.reason == "cost-model"
    assert threshold_of(moved) == pytest.approx(1 - 4000.5 / 4500)  # keeps 0.8 s of prefill
    # to another decoder's queue: local meets the whole 1 s target, so it stays
    kept = _decided(policy, context(tokens=4_500, prefillers=(flexible,)))
    assert threshold_of(kept) == 0.0 and kept.reason == "local"
    # 9000 tokens: local 1.8 s misses, remote 0.99 s meets it: keeps 1 s of prefill
    moved = _decided(policy, context(tokens=9_000, prefillers=(flexible,)))
    assert moved.reason == "cost-model"
    assert threshold_of(moved) == pytest.approx(1 - 5000.5 / 9000)
    # both miss (remote 1.65 s for 15 000 tokens): local, where it is cheaper
    assert threshold_of(_decided(policy, context(tokens=15_000, prefillers=(flexible,)))) == 0.0


def test_a_prefiller_that_also_decodes_has_no_share_of_this_prompt_cached() -> None:
    policy = _policy()
    warm = LoadSnapshot(1, 0, 0.0, 0.0, prefix_hit_rate=0.75)
    flexible = prefiller(reading=warm, in_flight=1, backlog=30_000, role=Role.BOTH)
    # its hit rate is its own conversations': it takes three quarters off its backlog
    # (the gateway's one request, 30k queued: 0.75 s) and nothing off this prompt
    # (2 s), plus the transfer
    assert policy.model.remote_ttft(
        context(tokens=20_000, prefillers=(flexible,)), policy.model.pools["decode"]
    ) == pytest.approx((30_000 * 0.25 + 20_000) / RATE + 0.2)


def test_a_queued_decoder_keeps_what_fits_its_room_the_rest_goes_to_a_warm_prefiller() -> None:
    policy = _policy()
    warm = (prefiller(reading=LoadSnapshot(0, 0, 0.0, 0.0, prefix_hit_rate=0.9)),)
    # wait 0.4 s; room 0.8 - 0.4 = 0.4 s; remote 8000 * 0.1 / RATE + 0.08 = 0.16 s
    ctx = context(tokens=8_000, dec=decoder(backlog=4_000), prefillers=warm)
    decision = _decided(policy, ctx)
    assert decision.reason == "cost-model"
    assert threshold_of(decision) == pytest.approx(1 - 4000.5 / 8000)
    assert _admits(threshold_of(decision), 8_000, 4_000) and not _admits(
        threshold_of(decision), 8_000, 4_001
    )


def test_no_compatible_prefiller_means_local() -> None:
    assert _policy().decide(context(tokens=50_000, prefillers=())).reason == "no-prefiller"


def test_learning_converges_to_a_changed_rate_and_ignores_unknown_caches() -> None:
    policy = _policy(alpha=0.2)
    model = policy.model.pools["decode"]

    def served(uncached: int, seconds: float, remote: bool = False, cached: int | None = 0) -> None:
        policy.observe(
            LatencyObservation(
                "m", "decode", 0.0, ttft=seconds, itl=0.012,
                prompt_tokens=uncached + (cached or 0), cached_tokens=cached, remote=remote,
            )
        )  # fmt: skip

    for _ in range(40):  # the engine got twice as slow
        served(5000, 1.0)
    assert model.rate_local == pytest.approx(5000.0, rel=0.01)
    served(5000, 0.25)  # an idle engine's 4x faster answer lifts it at once, by x1.5 at most
    assert model.rate_local == pytest.approx(1.5 * 5000.0, rel=0.01)
    served(5000, 0.25)
    served(5000, 0.25)
    served(5000, 0.25)  # and in a few samples it is there
    assert model.rate_local == pytest.approx(20_000.0)
    before = model.rate_local
    served(5000, 0.1, cached=None)  # no cached count: no sample
    assert model.rate_local == before
    for _ in range(40):
        served(10_000, 1.0 + 0.1, remote=True, cached=None)  # 0.1 s of transfer
    assert model.rate_remote == pytest.approx(10_000.0, rel=0.01)
    assert model.itl == pytest.approx(0.012)


def test_a_sample_that_waited_behind_a_queue_teaches_no_rate() -> None:
    # under sustained load every TTFT also times the queue ahead of it: learnt, it
    # pulled the decaying maximum down to a third of the engine's rate
    policy = _policy(alpha=0.2)
    model = policy.model.pools["decode"]

    def served(seconds: float, *, remote: bool, queued: bool | None) -> None:
        policy.observe(
            LatencyObservation(
                "m", "decode", 0.0, ttft=seconds, itl=0.02, prompt_tokens=5_000,
                cached_tokens=0, output_tokens=50, remote=remote, queued=queued,
                after_prefill=0.05 if remote else None,
            )
        )  # fmt: skip

    for _ in range(40):  # 3x the engine's time, all of it behind a queue
        served(1.5, remote=False, queued=True)
        served(1.5 + 0.05, remote=True, queued=True)
    assert model.rate_local == RATE and model.rate_remote == RATE
    assert model.itl == pytest.approx(0.02)  # the rest is still learnt
    assert policy.model.out_mean == pytest.approx(50.0)
    served(1.5, remote=False, queued=False)  # the same time with nothing ahead: learnt
    served(1.5 + 0.05, remote=True, queued=None)  # unknown: learnt as before
    assert model.rate_local < RATE and model.rate_remote < RATE


def test_a_remote_sample_faster_than_the_pool_could_prefill_is_a_cached_prompt() -> None:
    policy = _policy()
    model = policy.model.pools["decode"]  # local 10k tokens/s, no seed: up to 20k/s is plausible

    def remote(tokens: int, prefill: float) -> None:
        ttft = prefill + tokens / PARAMS.transfer_tokens_per_s
        policy.observe(
            LatencyObservation("m", "decode", 0.0, ttft=ttft, prompt_tokens=tokens, remote=True)
        )

    remote(30_000, 0.05)  # 600k/s: a re-asked document the prefiller held, not learnt
    assert model.rate_remote == RATE
    remote(15_000, 1.0)  # an idle prefiller faster than the estimate: learnt at once
    assert model.rate_remote == pytest.approx(15_000.0)
    model.seed = 40_000.0  # a hardware profile's seed raises the bound
    remote(30_000, 0.5)  # learnt, x1.5 at most a sample
    assert model.rate_remote == pytest.approx(22_500.0)


def test_a_p_d_sample_counts_what_its_prefiller_lacked_when_it_said() -> None:
    # counted whole, a prompt the prefiller held most of passes for a fast engine
    policy = _policy()
    model = policy.model.pools["decode"]  # 10k tokens/s; up to 20k/s is plausible

    def remote(tokens: int, held: int | None, prefill: float) -> None:
        ttft = prefill + tokens / PARAMS.transfer_tokens_per_s
        policy.observe(
            LatencyObservation(
                "m", "decode", 0.0, ttft=ttft, prompt_tokens=tokens, remote=True,
                prefill_cached=held,
            )
        )  # fmt: skip

    remote(6_000, 4_000, 0.2)  # 2,000 new tokens in 0.2 s: 10k/s, not 30k/s
    assert model.rate_remote == pytest.approx(RATE)
    remote(6_000, 5_800, 0.01)  # 200 new tokens: a fixed cost more than a rate
    assert model.rate_remote == pytest.approx(RATE)
    remote(9_000, 0, 0.6)  # said, nothing held: 15k/s, learnt
    assert model.rate_remote == pytest.approx(15_000.0)
    remote(30_000, None, 0.5)  # not said: 60k/s is above the bound, not learnt
    assert model.rate_remote == pytest.approx(15_000.0)


def test_a_p_d_sample_learns_from_its_prefill_leg_when_timed() -> None:
    # a decoder's slow rejection before the leg is no part of the prefill
    policy = _policy()
    model = policy.model.pools["decode"]  # 10k tokens/s
    hops = 2 * PARAMS.hop

    def remote(ttft: float, leg: float | None) -> None:
        policy.observe(
            LatencyObservation(
                "m", "decode", 0.0, ttft=ttft, prompt_tokens=9_000, remote=True,
                prefill_cached=0, after_prefill=0.05, prefill_seconds=leg,
            )
        )  # fmt: skip

    remote(0.05 + 0.9 + hops, None)  # untimed: 0.9 s before the answer, 10k/s
    assert model.rate_remote == pytest.approx(RATE)
    remote(0.05 + 0.9 + hops, 0.6 + hops)  # 0.3 s of it a rejection: the leg's 15k/s
    assert model.rate_remote == pytest.approx(15_000.0)


def test_seeds_come_from_the_known_profile_else_the_parameter() -> None:
    h200 = _known_h200()
    assert seed_rate(h200, 1.0) == pytest.approx(1 / 29.5e-6)
    other = Endpoint("d", "http://d:1", Role.DECODE, "h200", model="some/other-model")
    assert seed_rate(other, 1234.0) == 1234.0
    # a bare hardware label, even one the simulator's table has, picks no constants
    bare = Endpoint("d", "http://d:1", Role.DECODE, "h200", model=h200.model)
    assert profile_of(bare) is None and seed_rate(bare, 1234.0) == 1234.0
    policy = build({"type": "goodput", "params": {"ttft": 2.0}})
    assert isinstance(policy, GoodputPolicy) and policy.model.params.ttft == 2.0
    _decided(policy, context(dec=Candidate(h200, True, 0, None)))
    pool = policy.model.pools[h200.pool]
    assert pool.rate_local == pool.rate_remote == pool.seed == pytest.approx(1 / 29.5e-6)
    assert pool.attn == pytest.approx(0.96e-9)  # the profile's attention term
    linear = build({"type": "goodput", "params": {"prefill_attention": 0.0}})
    assert isinstance(linear, GoodputPolicy)
    linear.decide(context(dec=Candidate(h200, True, 0, None)))
    assert linear.model.pools[h200.pool].attn == 0.0  # the parameter wins


def test_a_prefill_pays_attention_over_every_token_before_each_new_one() -> None:
    model = PoolModel(20_000.0, 20_000.0, attn=1e-9)
    # 10,000 new tokens: 0.5 s at the rate, plus 1e-9 s per pair, 10,000 * 5,000 pairs
    assert model.prefill_seconds(20_000.0, 10_000, 0) == pytest.approx(0.55)
    # after 5,000 cached ones, each new token also attends to those
    assert model.prefill_seconds(20_000.0, 10_000, 5_000) == pytest.approx(0.6)
    # the most uncached tokens of a 20,000-token prompt within 0.4 s: fewer than the
    # linear 8,000, and exactly what takes 0.4 s
    within = model.tokens_within(0.4, 20_000)
    assert 5_000 < within < 8_000
    assert model.prefill_seconds(20_000.0, within, 20_000 - within) == pytest.approx(0.4)
    assert model.tokens_within(0.55, 10_000) == 10_000  # the whole prompt fits
    assert model.tokens_within(-0.1, 10_000) == pytest.approx(-2_000)  # none, linearly
    assert PoolModel(20_000.0, 20_000.0).tokens_within(0.4, 20_000) == 8_000


def test_attention_takes_a_long_local_prefill_past_the_target_and_it_goes_p_d() -> None:
    # a prefiller that also decodes, twice as fast; 9,500 uncached tokens on an idle
    # decoder: 0.95 s linearly, 1.18 s with attention (5e-9 s * 9,500 * 4,750 pairs)
    flexible = (prefiller(reading=load(), role=Role.BOTH),)
    ctx = context(tokens=9_500, prefillers=flexible)
    linear = _policy()
    linear.model.pools["decode"] = PoolModel(RATE, 2 * RATE, itl=0.01, free_tokens=0.0)
    assert linear.decide(ctx).reason == "local"
    policy = _policy()
    policy.model.pools["decode"] = PoolModel(RATE, 2 * RATE, itl=0.01, free_tokens=0.0, attn=5e-9)
    # remote: 0.475 s + 0.226 s of attention + 0.095 s of transfer meets the target
    decision = _decided(policy, ctx)
    assert decision.reason == "cost-model"
    assert not _admits(threshold_of(decision), 9_500, 9_500)
    # the decoder keeps what it prefills within the target
    kept = policy.model.pools["decode"].tokens_within(1.0, 9_500)
    assert _admits(threshold_of(decision), 9_500, round(kept))
    assert not _admits(threshold_of(decision), 9_500, round(kept) + 1)


def test_a_long_prefill_at_the_engine_s_speed_leaves_the_learnt_rates_where_they_are() -> None:
    # a linear model learns 25,000 tokens in 1.04 s as 24,100 tokens/s, and pulls the
    # rates down for every long prompt (long-doc: 10-15% below short prompts')
    h200 = _known_h200()
    policy = GoodputPolicy(PARAMS)
    _decided(policy, context(dec=Candidate(h200, True, 0, None)))
    model = policy.model.pools[h200.pool]
    profile = model.profile
    assert profile is not None
    prefill = profile.prefill_seconds(25_000, 0)
    assert prefill > 1.03
    for _ in range(20):
        policy.observe(
            LatencyObservation(
                "m", h200.pool, 0.0, ttft=prefill, prompt_tokens=25_000, cached_tokens=0,
                remote=False,
            )
        )  # fmt: skip
        transfer = 25_000 / PARAMS.transfer_tokens_per_s
        policy.observe(
            LatencyObservation(
                "m", h200.pool, 0.0, ttft=prefill + transfer, prompt_tokens=25_000,
                remote=True,
            )
        )  # fmt: skip
    assert model.rate_local == pytest.approx(model.seed)
    assert model.rate_remote == pytest.approx(model.seed)


def test_a_profile_too_fast_by_a_factor_is_corrected_in_both_its_terms() -> None:
    """A profile twice too optimistic (its rate twice the engine's, its attention term
    half) learnt back from local samples beside other work: the rate alone absorbed the
    term's error, and a long prompt stayed priced short (the wrong-belief bench). A
    profile within x1.25 of the engine keeps its term."""
    h200 = _known_h200()
    samples = [(n, n // 4) for n in [2_000, 4_000, 8_000, 16_000, 32_000]] * 20

    def learnt(belief: float, *, follows: bool = True, slower: float = 1.0) -> PoolModel:
        policy = GoodputPolicy(PARAMS)
        _decided(policy, context(dec=Candidate(h200, True, 0, None)))
        model = policy.model.pools[h200.pool]
        assert model.profile is not None
        engine = model.profile.prefill_seconds
        model.rate_local, model.seed = belief * model.rate_local, belief * model.seed
        model.attn /= belief
        model.shape = model.shape if follows else 0.0
        for new, held in samples:
            policy.observe(
                LatencyObservation(
                    "m", h200.pool, 0.0, ttft=slower * engine(new, held),
                    prompt_tokens=new + held, cached_tokens=held, remote=False,
                )
            )  # fmt: skip
        return model

    truth = learnt(2.0)
    profile = truth.profile
    assert profile is not None
    assert truth.rate_local == pytest.approx(truth.seed / 2, rel=0.02)
    assert truth.attn == pytest.approx(profile.attn, rel=0.02)
    for new, held in [(60_000, 0), (24_000, 8_000), (1_000, 0)]:
        seconds = profile.prefill_seconds(new, held)
        assert truth.local_seconds(new, new + held) == pytest.approx(seconds, rel=0.03)
    # the term held at the profile's half: a 60k-token prompt priced 10% or more short
    alone = learnt(2.0, follows=False)
    assert alone.attn == pytest.approx(profile.attn / 2)
    assert alone.local_seconds(60_000, 60_000) < 0.9 * profile.prefill_seconds(60_000, 0)
    # an engine 4% slower than a right profile: its rate follows, its term stays
    near = learnt(1.0, slower=1.04)
    assert near.rate_local < 0.97 * near.seed
    assert near.attn == profile.attn
    # a profile twice too slow is corrected too
    assert learnt(0.5).attn == pytest.approx(profile.attn, rel=0.02)


def test_before_any_itl_the_bare_step_is_the_hardware_profile_s() -> None:
    h200 = _known_h200()
    policy = GoodputPolicy(PARAMS)
    policy.model.out_mean = 100
    policy.model.out_low = 100  # no short stream: the mean bound binds
    busy = context(tokens=4_000, dec=Candidate(h200, True, 50, None))
    assert _decided(policy, busy).reason == "local"  # its 4000 tokens count in the share
    model = policy.model.pools[h200.pool]
    assert model.itl is None and model.profile is profile_of(h200) is not None
    # 50 streams of about 4000 + 50 tokens each, no prefill: the profile's roofline
    step = model.profile.step_seconds(50 * 4_050, 50)
    allowed = 1 - step / (0.03 * 0.5)
    left = allowed * 3.0 * model.rate_local - 4_000
    assert left > model.free_tokens
    assert policy.model.stall_limit(busy, model) == pytest.approx(left)
    other = Endpoint("o", "http://o:1", Role.DECODE, "h200", model="some/other-model", pool="o")
    assert profile_of(other) is None  # no profile: no step until the ITL is observed


def test_a_crowded_decoder_steps_as_its_profile_says_whatever_the_pool_s_itl() -> None:
    h200 = _known_h200()
    policy = GoodputPolicy(PARAMS)
    policy.model.out_mean, policy.model.prompt_mean = 100, 4_000
    policy.model.out_low = 100  # no short stream: the mean bound binds
    model = policy.model.pool(h200)
    assert model.profile is not None
    model.itl = 0.010  # the pool's mean, learnt while its decoders were quiet
    # four streams: the profile's step (about 7 ms) is below the observed 10 ms, which
    # stands
    assert model.profile.step_seconds(4 * 4_050, 4) < 0.010
    quiet = context(tokens=4_000, dec=Candidate(h200, True, 4, None))
    left = (1 - 0.010 / (0.03 * 0.5)) * 3.0 * model.rate_local
    assert policy.model.stall_limit(quiet, model) == pytest.approx(left)
    # 150 streams of 4k tokens: the profile's step is past the goal's 15 ms on its own,
    # so only what a step carries for free is left, and 1,000 uncached tokens go P/D
    assert model.profile.step_seconds(150 * 4_050, 150) > 0.015
    crowded = context(tokens=4_000, cached=3_000, dec=Candidate(h200, True, 150, None))
    assert policy.model.stall_limit(crowded, model) == model.free_tokens
    decision = _decided(policy, crowded)
    assert decision.reason == "stall" and not _admits(threshold_of(decision), 4_000, 1_000)
    # the same prompt on the quiet decoder stays
    assert _admits(
        threshold_of(_decided(policy, context(tokens=4_000, cached=3_000, dec=quiet.decoder))),
        4_000,
        1_000,
    )


def test_an_itl_observed_before_an_idle_spell_no_longer_sets_the_bare_step() -> None:
    h200 = _known_h200()
    policy = GoodputPolicy(PARAMS)
    policy.model.out_mean, policy.model.prompt_mean = 100, 4_000  # W = 3 s
    policy.model.out_low = 100  # no short stream: the mean bound binds
    model = policy.model.pool(h200)
    assert model.profile is not None
    # the pool's ITL, learnt while its decoders were busy, past the goal's 15 ms
    policy.observe(LatencyObservation("m", h200.pool, 100.0, itl=0.016))
    assert model.itl == pytest.approx(0.016)
    step = model.profile.step_seconds(4 * 4_050, 4)  # four streams now: about 7 ms
    assert step < 0.016 * math.exp(-0.5)
    # just after the sample it stands: only what a step carries for free is left
    now = context(tokens=4_000, dec=Candidate(h200, True, 4, None), now=100.0)
    assert policy.model.stall_limit(now, model) == model.free_tokens
    # half a window later, it counts e^-0.5 of itself, and after an idle spell of ten
    # windows the streams it timed have long finished: the profile's step for the
    # four decoding now
    later = context(tokens=4_000, dec=Candidate(h200, True, 4, None), now=101.5)
    left = (1 - 0.016 * math.exp(-0.5) / (0.03 * 0.5)) * 3.0 * model.rate_local
    assert policy.model.stall_limit(later, model) == pytest.approx(left)
    idle = context(tokens=4_000, dec=Candidate(h200, True, 4, None), now=130.0)
    left = (1 - step / (0.03 * 0.5)) * 3.0 * model.rate_local
    assert policy.model.stall_limit(idle, model) == pytest.approx(left, rel=1e-3)


def test_without_a_profile_the_observed_itl_ages_but_never_below_the_pools_itl() -> None:
    # before a step is learnt against the batch, the pool's ITL is the only measure of
    # the step: the observed one ages, but a stream's step is never priced free
    policy = _policy()
    model = policy.model.pools["decode"]
    policy.model.out_mean = 100  # W = 3 s
    assert model.profile is None
    model.itl, model.itl_at = 0.016, 100.0  # learnt while busy, past the goal's 15 ms
    assert not model.steps.octaves
    assert policy.model.recent_itl(model, 100.0) == pytest.approx(0.016)
    assert policy.model.recent_itl(model, 103.0) == pytest.approx(0.016 * math.exp(-1))
    assert policy.model.recent_itl(model, 1_000.0) < 1e-9
    busy = context(tokens=4_000, dec=decoder(in_flight=1), now=1_000.0)
    assert policy.model.stall_limit(busy, model) == model.free_tokens


def _stepped() -> tuple[GoodputPolicy, PoolModel]:
    """A policy with no profile (``W`` 3 s, the mean bound binding) whose pool learnt
    its step against the batch from ITLs at 2 to 8 streams: 5 ms + 0.25 ms a stream."""
    policy = _policy()
    policy.model.out_mean, policy.model.out_low = 100, 100
    model = policy.model.pools["decode"]
    model.itl = None
    for _ in range(100):
        for streams in (1, 3, 7):
            itl = 0.005 + 0.00025 * (streams + 1)
            policy.observe(LatencyObservation("m", "decode", 0.0, itl=itl, streams=streams))
    return policy, model


def test_without_a_profile_a_busy_spells_itl_yields_to_the_learnt_step_when_idle() -> None:
    """The ITL of the last busy spell (a warm-up's tail, 19 ms at 40 streams) held the
    stall bound at the free chunk for good: after an idle spell, the step learnt at the
    streams decoding now (5.5 ms at two) sets it, as a profile's step does."""
    policy, model = _stepped()
    for _ in range(100):  # the busy spell's end: at 40 streams, half the time prefilling
        policy.observe(LatencyObservation("m", "decode", 100.0, itl=0.019, streams=39))
    assert model.itl == pytest.approx(0.019, rel=0.01)
    assert model.steps.at(2) < 0.0065
    now = context(tokens=4_000, dec=decoder(in_flight=2), now=100.0)
    assert policy.model.stall_limit(now, model) == model.free_tokens  # the goal is spent
    idle = context(tokens=4_000, dec=decoder(in_flight=2), now=130.0)  # ten windows later
    left = (1 - model.steps.at(2) / (0.03 * 0.5)) * 3.0 * RATE
    assert policy.model.stall_limit(idle, model) == pytest.approx(left, rel=1e-3)


def test_without_a_profile_the_step_is_learnt_against_the_batch() -> None:
    """ITLs timed at 2 to 8 streams (5 ms + 0.25 ms a stream) price a step at 40
    streams (15 ms) that the mean ITL (about 6 ms) does not: a prompt a quiet decoder
    keeps goes P/D from a crowded one."""
    policy, model = _stepped()
    assert model.itl is not None and model.itl < 0.0065
    assert model.steps.at(40) == pytest.approx(0.015, rel=0.01)
    learnt = policy.model.learnt()["decode"]
    assert learnt["step_per_stream"] == pytest.approx(0.00025, rel=0.01)
    assert policy.model.stream_step(model, 4_000, 40) == model.steps.at(40)
    quiet = context(tokens=4_000, cached=2_000, dec=decoder(in_flight=4))
    left = (1 - max(model.itl, model.steps.at(4)) / (0.03 * 0.5)) * 3.0 * RATE
    assert policy.model.stall_limit(quiet, model) == pytest.approx(left)
    assert _admits(threshold_of(_decided(policy, quiet)), 4_000, 2_000)
    crowded = context(tokens=4_000, cached=2_000, dec=decoder(in_flight=40))
    assert policy.model.stall_limit(crowded, model) < 100  # the goal is spent
    assert not _admits(threshold_of(_decided(policy, crowded)), 4_000, 2_000)


def test_an_octave_line_with_no_seed_takes_its_first_sample_whole() -> None:
    line = OctaveLine()
    line.learn(4, 0.008, alpha=0.05)
    assert (line.fixed, line.slope) == (0.008, 0.0)  # one octave: flat
    line.learn(4, 0.1, alpha=0.05)  # far off: clipped to x1.5 before the step
    assert line.at(4) == pytest.approx(0.008 + 0.05 * 0.004)


LLAMA = "meta-llama/Llama-3.1-8B-Instruct"


def _h200(name: str, role: Role = Role.DECODE, *, spill: bool = False, streams: int = 0,
          backlog: int = 0) -> Candidate:  # fmt: skip
    endpoint = Endpoint(
        name,
        f"http://{name}:1",
        role,
        "h200",
        model=LLAMA,
        pool=role.value,
        spill=spill,
        knowledge=H200,
    )
    return Candidate(endpoint, True, streams, None, backlog)


def test_a_crowded_decoder_spills_the_prompt_whole_to_a_prefiller_that_serves_whole_requests() -> (
    None
):
    policy = GoodputPolicy(PARAMS)  # the stream goal: 15 ms a step
    policy.model.out_mean, policy.model.prompt_mean = 100, 4_000
    crowded, quiet = _h200("d", streams=150), _h200("d", streams=4)
    spilling = _h200("p0", Role.PREFILL, spill=True, streams=10)

    def decide(dec: Candidate, *prefillers: Candidate) -> Route:
        return _decided(policy, context(tokens=4_000, cached=3_000, dec=dec, prefillers=prefillers))

    # 150 streams of 4k tokens step past the goal: the stream goes where 10 decode
    assert decide(crowded, spilling) == Whole("goodput", "spill", "p0")
    # never to one out of rotation
    assert _named(decide(crowded, replace(spilling, healthy=False))) is None
    # a prefiller whose pool does not spill: the prompt goes P/D and the stream stays
    assert decide(crowded, _h200("p0", Role.PREFILL)).reason == "stall"
    # a quiet decoder keeps it
    assert decide(quiet, spilling).reason == "local"
    # a prefiller as crowded as the decoder is no better place for the stream
    assert _named(decide(crowded, _h200("p0", Role.PREFILL, spill=True, streams=150))) is None
    # of two that answer as soon, the one with fewer streams
    fuller = _h200("p1", Role.PREFILL, spill=True, streams=60)
    assert _named(decide(crowded, fuller, spilling)) == "p0"
    # one that holds the prompt (by the gateway's prefix index) answers sooner
    held = context(tokens=4_000, cached=3_000, dec=crowded, prefillers=(fuller, spilling))
    held = _holding(held, lambda e: 4_000 if e.name == "p1" else 0)
    assert _named(_decided(policy, held)) == "p1"
    # one whose queue alone takes the whole TTFT target is no place for the prompt
    rate = policy.model.pool(spilling.endpoint).rate_local
    behind = _h200("p0", Role.PREFILL, spill=True, streams=10, backlog=round(rate))
    assert _named(decide(crowded, behind)) is None


def test_a_queued_decoder_spills_to_a_prefiller_that_starts_the_prompt_sooner() -> None:
    policy = _policy()  # no profile: the decoder's step is its pool's ITL, 10 ms
    policy.model.pools["prefill"] = PoolModel(RATE, RATE)
    queued = decoder(backlog=20_000)  # 2 s of prefill ahead: past 0.8 of the target

    def spilling(backlog: int = 0) -> Candidate:
        endpoint = Endpoint("p0", "http://p0:1", Role.PREFILL, "h200", pool="prefill", spill=True)
        return Candidate(endpoint, True, 0, None, backlog)

    def decide(dec: Candidate, prefiller: Candidate) -> Route:
        return _decided(policy, context(tokens=2_000, cached=0, dec=dec, prefillers=(prefiller,)))

    assert decide(queued, spilling()) == Whole("goodput", "spill", "p0")
    # a prefiller that would answer after the TTFT target (1.05 s): nor would a drain
    # to it meet the target (1.07 s, against 2.2 s locally), so the prompt waits
    late = decide(queued, spilling(8_500))
    assert late.reason == "queued" and threshold_of(late) == 0.0
    # with 6,000 tokens queued there it answers the whole request in 0.8 s
    assert _named(decide(queued, spilling(6_000))) == "p0"
    # served whole, its queue counts whole whatever its hit rate (it decodes what it
    # serves whole meanwhile): with a 90% hit rate read, 9,900 tokens queued are 0.99 s,
    # and the request is not served there; a P/D prefill there (0.14 s at that hit
    # rate) drains the decoder instead
    warm = replace(spilling(9_900), load=LoadSnapshot(0, 0, 0.0, 0.0, prefix_hit_rate=0.9))
    assert decide(queued, warm).reason == "drain"
    # a decoder with room in its share keeps its prompt
    assert decide(decoder(), spilling()).reason == "local"


def test_a_spilling_prefiller_the_routing_picks_serves_the_prompt_whole_if_it_would_keep_it() -> (
    None
):
    def spilling(backlog: int = 0) -> Candidate:
        endpoint = Endpoint("p0", "http://p0:1", Role.PREFILL, "h200", pool="prefill",
                            spill=True)  # fmt: skip
        return Candidate(endpoint, True, 0, None, backlog)

    def picked(
        pick: Candidate, held: int, others: tuple[Candidate, ...] = (prefiller("p1"),)
    ) -> tuple[GoodputPolicy, Route]:
        policy = _policy()
        policy.model.pools["prefill"] = PoolModel(RATE, RATE)
        asked = context(tokens=4_000, cached=held, dec=pick, prefillers=others)
        return policy, _decided(policy, asked)

    # the routing picked p0, which holds 3,500 of the 4,000 tokens: 50 ms of prefill there
    policy, decision = picked(spilling(), 3_500)
    assert decision == Whole("goodput", "spill", "p0")
    # the 500 tokens it prefills count in its duty cycle
    assert policy.model.duty["p0"].tokens == pytest.approx(500)
    # holding none of it, 0.4 s of prefill there still meets the target
    assert _named(picked(spilling(), 0)[1]) == "p0"
    # its queue spends the target (1 s of prefill ahead): it declines the request (the
    # planner then ranks the decoders alone), and its duty cycle counts nothing
    policy, decision = picked(spilling(backlog=10_000), 0)
    assert decision == Decline("goodput", "declined") and not policy.model.duty
    # the only prefiller: no remote path to weigh, so it takes what its queue has room for
    assert _named(picked(spilling(), 0, others=())[1]) == "p0"
    assert picked(spilling(backlog=10_000), 0, others=())[1].reason == "declined"
    # a 20,000-token prompt it holds 19,000 of, with remote prefill twice as fast: the
    # remote path takes 1.2 s, so the cost model keeps at most 12,000 uncached tokens
    # there (a threshold, not ``local``); the 1,000 it lacks are within that
    policy = _policy()
    policy.model.pools["prefill"] = PoolModel(RATE, 2 * RATE)
    long = context(tokens=20_000, cached=19_000, dec=spilling(), prefillers=(prefiller("p1"),))
    decision = _decided(policy, long)
    assert decision == Whole("goodput", "spill", "p0")
    assert policy.model.duty["p0"].tokens == pytest.approx(1_000)
    # holding none of it, 20,000 tokens exceed what it keeps: declined
    assert (
        _decided(policy, _holding(long, lambda e: 0 if e.name == "p0" else None)).reason
        == "declined"
    )


def test_a_routed_pick_counts_its_queue_at_the_prompt_s_share_when_its_reading_says_less() -> None:
    # the routing picked p0 for a 6,000-token prompt it holds 5,400 of; 60,000 tokens
    # are queued there and its reading says half of what it was asked hit
    reading = LoadSnapshot(0, 0, 0.0, 0.0, prefix_hit_rate=0.5)
    endpoint = Endpoint("p0", "http://p0:1", Role.PREFILL, "h200", pool="prefill", spill=True)
    pick = Candidate(endpoint, True, 10, reading, 60_000)
    policy = _policy()
    policy.model.pools["prefill"] = PoolModel(RATE, RATE)
    asked = context(tokens=6_000, cached=5_400, dec=pick, prefillers=(prefiller("p1"),))
    # at the prompt's 90%: 0.6 s of prefill ahead, room in the 0.8 s share: served whole
    assert _decided(policy, asked) == Whole("goodput", "spill", "p0")
    # a reading above the prompt's share stands: at 95%, 0.3 s
    warmer = replace(pick, load=LoadSnapshot(0, 0, 0.0, 0.0, prefix_hit_rate=0.95))
    assert _wait(policy, replace(asked, decoder=warmer), policy.model.pools["prefill"]) == (
        pytest.approx(0.3)
    )
    # a decoder with the same queue and reading counts it at its reading's 50%: 3 s
    # ahead, it drains the prompt to the idle prefiller
    queued = Candidate(decoder().endpoint, True, 10, reading, 60_000)
    assert _decided(policy, replace(asked, decoder=queued)).reason == "drain"


def test_a_queued_routed_pick_serves_the_prompt_whole_only_if_it_still_answers_in_time() -> None:
    # the routing picked p0 for a 1,000-token prompt it holds none of (0.1 s of prefill);
    # the other prefiller is 2 s behind, so nothing drains
    def asked(backlog: int) -> ThresholdContext:
        endpoint = Endpoint("p0", "http://p0:1", Role.PREFILL, "h200", pool="prefill", spill=True)
        pick = Candidate(endpoint, True, 0, None, backlog)
        busy = prefiller("p1", backlog=20_000)
        return context(tokens=1_000, cached=0, dec=pick, prefillers=(busy,))

    policy = _policy()
    policy.model.pools["prefill"] = PoolModel(RATE, RATE)
    # 0.85 s queued spends the 0.8 s share, but the answer starts at 0.95 s: served whole
    assert _decided(policy, asked(8_500)) == Whole("goodput", "spill", "p0")
    assert policy.model.duty["p0"].tokens == pytest.approx(1_000)
    # 0.95 s queued: 1.05 s, past the target; declined, and its duty cycle is unchanged
    assert _decided(policy, asked(9_500)) == Decline("goodput", "declined")
    assert policy.model.duty["p0"].tokens == pytest.approx(1_000)
    # a decoder in the same state keeps the prompt all the same (reason ``queued``)
    queued = _decided(policy, replace(asked(9_500), decoder=decoder(backlog=9_500)))
    assert queued == Local("goodput", "queued")


def test_deciding_changes_nothing_the_hit_rates_it_read_are_remembered_when_told() -> None:
    policy = _policy()
    rated = LoadSnapshot(1, 0, 0.0, 0.0, prefix_hit_rate=0.5)
    peer = decoder("d1", reading=rated)  # read only for a drain
    asked = context(tokens=4_000, dec=decoder(reading=rated), peers=(peer,))
    route = policy.decide(asked)
    assert route == Local("goodput", "local")
    assert not policy.model.hits and not policy.model.duty  # decide wrote nothing
    policy.chosen(asked, route)
    # the decoder's reading was read (the prefiller's gives no rate); the peer's was not
    assert policy.model.hits == {"d0": 0.5} and policy.model.duty["d0"].tokens == 2_000


def test_twenty_warm_samples_with_no_cached_count_leave_the_local_rate_alone() -> None:
    """Stock vLLM (no ``--enable-prompt-tokens-details``) says nothing of a warm
    prompt's cached tokens: the transcript and the gateway keep that unknown, and
    the policy learns nothing from it (once: one 4k-token prompt served in 30 ms
    moved the rate x6.4)."""
    policy = _policy(alpha=0.2)
    model = policy.model.pools["decode"]
    before = model.rate_local
    reports = CacheReports()
    for _ in range(20):
        body = {"model": "m", "prompt": "x"}
        view = parse_request(CompletionRequest, body)
        request = ClientRequest("completion", "/v1/completions", body, view, "rid", 0.0)
        transcript = Transcript(request)
        usage = {"prompt_tokens": 4096, "completion_tokens": 8}  # no prompt_tokens_details
        transcript.absorb_usage(usage, original_prompt=True, leg_tokens=8)
        cached = reports.resolve("d", transcript.cached_tokens)
        policy.observe(
            LatencyObservation(
                "m", "decode", 0.0, ttft=0.03, itl=0.012,
                prompt_tokens=4096, cached_tokens=cached, remote=False,
            )
        )  # fmt: skip
    assert abs(model.rate_local - before) < 0.1 * before


def test_one_far_sample_with_a_known_count_moves_a_rate_by_a_bounded_step() -> None:
    policy = _policy(alpha=0.2)
    model = policy.model.pools["decode"]
    before = model.rate_local
    tokens = 6000
    policy.observe(  # 6x the learnt rate, counted cold
        LatencyObservation(
            "m", "decode", 0.0, ttft=tokens / (6 * before) + 2 * PARAMS.hop,
            prompt_tokens=tokens, cached_tokens=0, remote=False,
        )
    )  # fmt: skip
    assert model.rate_local == pytest.approx(1.5 * before)
    policy.observe(  # 100x slower (a long queue): a small step down
        LatencyObservation(
            "m", "decode", 0.0, ttft=100 * tokens / model.rate_local,
            prompt_tokens=tokens, cached_tokens=0, remote=False,
        )
    )  # fmt: skip
    assert model.rate_local >= (1 - 0.2) * 1.5 * before


def _learnt_from(
    samples: list[float],
    *,
    alone: bool | None,
    remote: bool = False,
    tokens: list[int] | None = None,
) -> float:
    """The rate a pool seeded four times below :data:`RATE` learns from ``samples``
    (rates, tokens/s) of cold prompts (4,000 tokens, else ``tokens``), each timed alone
    or not."""
    policy = _policy()
    model = policy.model.pools["decode"] = PoolModel(RATE / 4, RATE / 4, itl=0.01)
    for rate, length in zip(samples, tokens or [4_000] * len(samples), strict=True):
        seconds = length / rate
        policy.observe(
            LatencyObservation(
                "m", "decode", 0.0, ttft=seconds + (0.05 if remote else 0.0), itl=0.01,
                prompt_tokens=length, cached_tokens=0, prefill_cached=0, remote=remote,
                after_prefill=0.05 if remote else None, alone=alone,
            )
        )  # fmt: skip
    return model.rate_remote if remote else model.rate_local


@pytest.mark.parametrize("remote", [False, True])
def test_samples_timed_alone_teach_the_engine_s_rate_not_its_fastest(remote: bool) -> None:
    """An engine alone jitters both ways (a fifth, request to request, on the CPU
    pair); the decaying maximum of such samples sat above its rate by about that,
    their median sits on it (2,000 draws of twelve samples each)."""
    rng = random.Random(7)
    alone, beside = [], []
    for _ in range(2_000):
        samples = [RATE * math.exp(rng.gauss(0.0, 0.2)) for _ in range(12)]
        alone.append(_learnt_from(samples, alone=True, remote=remote) / RATE)
        beside.append(_learnt_from(samples, alone=None, remote=remote) / RATE)
    assert statistics.median(alone) == pytest.approx(1.0, abs=0.03)
    assert sum(abs(r - 1.0) > 0.25 for r in alone) < 0.02 * len(alone)
    assert statistics.median(beside) > 1.15  # what the change removed


def test_samples_timed_alone_at_several_lengths_teach_the_fastest_length_s_rate() -> None:
    """A fixed cost makes short prompts look slow (and attention long ones): the rate
    of a linear model is where the engine runs fastest, as the decaying maximum
    found it, each length's jitter taken by its median."""
    lengths = [600, 1_500, 3_000, 6_000, 12_000, 24_000] * 2
    shape = {600: 0.6, 1_500: 0.8, 3_000: 0.95, 6_000: 1.0, 12_000: 0.9, 24_000: 0.7}
    samples = [RATE * shape[n] for n in lengths]
    assert _learnt_from(samples, alone=True, tokens=lengths) == pytest.approx(RATE)
    jitter = [1.1] * 6 + [0.9] * 6  # each length once fast, once slow
    jittered = [s * j for s, j in zip(samples, jitter, strict=True)]
    assert _learnt_from(jittered, alone=True, tokens=lengths) == pytest.approx(RATE)


def _engine_seconds(new: int, held: int = 0) -> float:
    """An engine with a fixed cost per prefill (20 ms), :data:`RATE` and an attention
    term of 1e-9 s a pair: its prefill of ``new`` tokens after ``held``."""
    return 0.02 + new / RATE + 1e-9 * new * (held + new / 2)


def _fitting(samples: list[tuple[int, int, float]]) -> PoolModel:
    """A pool with no attention term known (as seeded with no profile), four times
    below :data:`RATE`, after local ``samples`` (new, held, seconds) each timed alone."""
    policy = _policy()
    model = policy.model.pools["decode"] = PoolModel(RATE / 4, RATE / 4, fits_attn=True)
    for new, held, seconds in samples:
        policy.observe(
            LatencyObservation(
                "m", "decode", 0.0, ttft=seconds, prompt_tokens=new + held,
                cached_tokens=held, remote=False, alone=True,
            )
        )  # fmt: skip
    return model


def test_with_no_profile_samples_timed_alone_at_several_lengths_teach_the_attention_term() -> None:
    """Without it a model prices a long prefill at the rate of the fastest length and
    keeps on a decoder a prompt that stalls its streams for far longer (the cold
    development rows of the no-profile bench)."""
    lengths = [1_000, 2_000, 4_000, 8_000, 16_000, 32_000] * 2
    rng = random.Random(3)
    samples = [(n, 0, _engine_seconds(n) * math.exp(rng.gauss(0.0, 0.05))) for n in lengths]
    model = _fitting(samples)
    assert model.attn == pytest.approx(1e-9, rel=0.25)
    for new, held in [(32_000, 0), (60_000, 0), (8_000, 24_000)]:  # held out: 60k, a cached part
        predicted = model.local_seconds(new, new + held)
        assert predicted == pytest.approx(_engine_seconds(new, held), rel=0.1), (new, held)
    assert _fitting([]).attn == 0.0
    # a few samples say nothing of it: with one slowed by a prompt that arrived while it
    # prefilled, six (the cold start of a bench row) showed four times the engine's term
    few = [(n, 0, _engine_seconds(n)) for n in [2_000, 2_300, 6_800, 7_300, 10_500]]
    assert _fitting([*few, (12_800, 0, 1.25 * _engine_seconds(12_800))]).attn == 0.0
    slowed = [*samples[:8], *[(n, 0, 1.25 * s) for n, _, s in samples[8:]]]  # a third slowed
    assert _fitting(slowed).attn == pytest.approx(1e-9, rel=0.4)
    one_length = _fitting([(4_000, 0, _engine_seconds(4_000))] * 6)
    assert one_length.attn == 0.0  # one length shows no attention term: none learnt
    assert one_length.rate_local == pytest.approx(4_000 / _engine_seconds(4_000))


def test_a_known_attention_term_is_not_learnt() -> None:
    samples = [(n, 0, _engine_seconds(n)) for n in [1_000, 4_000, 16_000, 32_000] * 2]
    policy = _policy()
    model = policy.model.pools["decode"] = PoolModel(RATE / 4, RATE / 4, attn=2e-9)
    for new, _, seconds in samples:
        policy.observe(
            LatencyObservation(
                "m", "decode", 0.0, ttft=seconds, prompt_tokens=new, cached_tokens=0,
                remote=False, alone=True,
            )
        )  # fmt: skip
    assert model.attn == 2e-9
    seeded = build({"type": "goodput", "params": {"prefill_attention": 0.0}})
    assert isinstance(seeded, GoodputPolicy)
    seeded.decide(context())
    assert not any(pool.fits_attn for pool in seeded.model.pools.values())
    unknown = build({"type": "goodput"})
    assert isinstance(unknown, GoodputPolicy)
    unknown.decide(context())
    assert all(pool.fits_attn for pool in unknown.model.pools.values())


def test_samples_timed_alone_climb_from_low_seeds_in_bounded_steps() -> None:
    assert _learnt_from([RATE], alone=True) == pytest.approx(1.5 * RATE / 4)
    assert _learnt_from([RATE] * 4, alone=True) == pytest.approx(RATE)


def test_one_far_sample_timed_alone_moves_a_settled_rate_by_nothing() -> None:
    settled = [RATE] * 5
    assert _learnt_from([*settled, 10 * RATE], alone=True) == pytest.approx(RATE)
    assert _learnt_from([*settled, RATE / 10], alone=True) == pytest.approx(RATE)
    assert _learnt_from([*settled, *[RATE / 10] * 4], alone=True) == pytest.approx(RATE)
    # as many slower as settled is a changed engine: the rate follows, by a bounded step
    assert _learnt_from([*settled, *[RATE / 10] * 5], alone=True) == pytest.approx(RATE / 1.5)


def test_a_decoder_is_known_to_report_cached_counts_once_it_says_one() -> None:
    reports = CacheReports(silent_after=3)
    assert reports.resolve("d", None) is None  # cold, or a server that never says
    assert reports.state("d") == "unknown"
    assert reports.resolve("d", 128) == 128
    assert reports.resolve("d", None) == 0  # it says when it has some: none cached
    assert reports.state("d") == "reporting"


def test_a_decoder_that_never_reports_cached_counts_is_named_with_the_flag(
    caplog: pytest.LogCaptureFixture,
) -> None:
    reports = CacheReports(silent_after=3)
    with caplog.at_level(logging.WARNING, logger="pd_orchestrator.fleet.cache_reports"):
        for _ in range(5):
            assert reports.resolve("decode-0", None) is None
    assert reports.state("decode-0") == "silent"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "decode-0" in warnings[0] and "--enable-prompt-tokens-details" in warnings[0]
    after = CacheReports(silent_after=3)
    after.inherit(reports)  # a reload keeps it
    assert after.state("decode-0") == "silent"


def test_the_hand_over_s_fixed_and_per_token_costs_are_learnt_apart() -> None:
    """A hand-over of 150 ms plus 2 us a token (orchestration dominates, as NIXL
    traces show), learnt from a seed with no fixed cost and 3.3 us a token."""
    costs = OctaveLine(0.0, 1 / 300_000)
    lengths = (512, 1_024, 2_048, 4_096, 8_192, 16_384)
    for _ in range(200):
        for tokens in lengths:
            costs.learn(tokens, 0.150 + 2e-6 * tokens, alpha=0.1)
    assert costs.fixed == pytest.approx(0.150, rel=0.1)
    assert costs.slope == pytest.approx(2e-6, rel=0.1)


def test_one_far_hand_over_sample_moves_the_costs_by_a_bounded_step() -> None:
    costs = OctaveLine(0.010, 3e-6)
    for tokens in (1_024, 8_192):
        costs.learn(tokens, costs.at(tokens), alpha=0.1)
    before = costs.at(8_192)
    costs.learn(8_192, 100.0, alpha=0.1)  # a hand-over stalled behind something else
    assert before < costs.at(8_192) <= before * (1 + 0.1 * 0.5) + 1e-12
    costs.learn(8_192, float("nan"), alpha=0.1)  # ignored
    costs.learn(0, 1.0, alpha=0.1)
    assert costs.at(8_192) <= before * 1.05 + 1e-12


def test_a_hand_over_five_times_dearer_than_believed_is_learnt_in_a_dozen_samples() -> None:
    """The median of an octave's last samples follows a link five times slower than
    believed within a dozen samples an octave, where a moving mean takes 65 (the
    wrong-belief bench: the 40k-token octave took four minutes)."""

    def learnt(recent: int, samples: int) -> OctaveLine:
        costs = OctaveLine(0.010, 0.6e-6, recent=recent)  # believed: 1/5 of 3 us a token
        for _ in range(samples):
            for tokens in (2_000, 40_000):
                costs.learn(tokens, 0.010 + 3e-6 * tokens, alpha=0.05)
        return costs

    truth = 0.010 + 3e-6 * 40_000
    assert learnt(8, 12).at(40_000) == pytest.approx(truth, rel=0.1)
    assert learnt(0, 12).at(40_000) < 0.5 * truth  # a moving mean: a third of the way
    assert learnt(0, 80).at(40_000) == pytest.approx(truth, rel=0.1)


def test_with_recent_samples_a_minority_of_far_ones_moves_no_octave_beyond_the_rest() -> None:
    costs = OctaveLine(0.010, 3e-6, recent=8)
    value = costs.at(8_192)
    costs.learn(8_192, 100.0, alpha=0.05)  # one stalled hand-over: half the clip at most
    assert value < costs.at(8_192) <= value * 1.25 + 1e-12
    for _ in range(7):
        costs.learn(8_192, value, alpha=0.05)
    for y in (100.0, 1e-6, 100.0):  # three of eight far off, both ways
        costs.learn(8_192, y, alpha=0.05)
    assert costs.at(8_192) == pytest.approx(value)
    assert len(costs.kept[(8_192).bit_length()]) == 8


def test_p_d_samples_teach_the_hand_over_apart_from_the_remote_rate() -> None:
    """With the prefill answer's time known, the TTFT splits: before it, the remote
    prefill (its rate); after it, the hand-over (its costs)."""
    policy = GoodputPolicy(PARAMS.model_copy(update={"transfer_tokens_per_s": None}))
    policy.model.params = policy.model.params.model_copy(update={"alpha": 0.2})
    model = policy.model.pool(decoder("d0").endpoint)
    rate = model.rate_remote
    for _ in range(60):
        for tokens in (2_000, 8_000):
            after = 0.100 + 1e-6 * tokens  # the decode leg: 100 ms + 1 us a token
            policy.observe(
                LatencyObservation(
                    "m", "decode", 0.0, ttft=tokens / rate + after, prompt_tokens=tokens,
                    cached_tokens=0, remote=True, after_prefill=after,
                )
            )  # fmt: skip
    assert model.handover.fixed == pytest.approx(0.100, rel=0.1)
    assert model.handover.slope == pytest.approx(1e-6, rel=0.15)
    assert model.rate_remote == pytest.approx(rate, rel=0.01)  # the hand-over is not prefill


def test_a_ttft_target_that_scales_with_the_prompt_makes_a_long_remote_path_sure() -> None:
    policy = _policy(ttft_scale=3.0)
    pool = policy.model.pools["decode"]
    short = context(tokens=2_000, prefillers=(prefiller(reading=load()),))
    assert policy.model.ttft_target(short, pool) == 1.0  # 3 x 0.1 s alone: the floor
    busy_decoder = decoder(in_flight=30)
    long = context(tokens=9_500, dec=busy_decoder, prefillers=(prefiller(reading=load()),))
    # the prefiller pool's seeds are a guess until it learns: 3 x 0.95 s on the decoder's
    assert policy.model.ttft_target(long, pool) == pytest.approx(2.85)
    policy.model.pool(long.prefillers[0].endpoint).measured = True  # it learnt a sample
    # 3 x 0.475 s alone: the prefiller pool's rate, 20,000 tokens/s, is the fastest
    assert policy.model.ttft_target(long, pool) == pytest.approx(1.425)
    policy.model.out_mean = 10  # window 0.3 s: 1000 tokens of room
    policy.model.out_low = 10  # no short stream: the mean bound binds
    # remote 1.045 s: past a fixed 1 s target, within 1.425 s, so the stall bound
    # applies and the busy decoder keeps only its room
    scaled = _decided(policy, long)
    assert scaled.reason == "stall"
    assert threshold_of(scaled) == pytest.approx(1 - 1000.5 / 9_500)
    fixed = _policy()
    fixed.model.out_mean = 10
    fixed.model.out_low = 10
    assert _decided(fixed, long).reason == "local"


def test_a_short_stream_bounds_one_local_prefill_by_the_stall_it_tolerates() -> None:
    policy = _policy()
    policy.model.out_mean = 100  # window 3 s: 10,000 tokens of room for the mean stream
    policy.model.out_low = 10  # but one stream in ten has 10 tokens or fewer
    model = policy.model.pools["decode"]
    busy = decoder(in_flight=8)
    long = context(tokens=3_000, dec=busy)
    # a 10-token stream that takes a whole stall of s over its tokens runs at about
    # 10 ms + s / 10 a token: s <= 0.2 s, 2,000 tokens at 10k tokens/s
    assert policy.model.stall_limit(long, model) == pytest.approx(2_000.0)
    sure = (prefiller(reading=load()),)
    decision = _decided(policy, context(tokens=3_000, dec=busy, prefillers=sure))
    assert decision.reason == "stall"
    assert threshold_of(decision) == pytest.approx(1 - 2_000.5 / 3_000)
    # a prompt that fits whole is kept, and the mean bound alone stands then
    assert _decided(policy, context(tokens=1_500, dec=busy, prefillers=sure)).reason == "local"
    policy.model.out_low = 100
    policy.model.duty.clear()  # forget what the two decisions kept
    assert policy.model.stall_limit(long, model) == pytest.approx(10_000.0)
    # past the TPOT already: only what a step carries for free
    model.itl, model.free_tokens = 0.04, 150.0
    assert policy.model.stall_limit(long, model) == 150.0


def test_the_short_output_is_the_quantile_of_the_outputs_the_attainment_leaves_out() -> None:
    outputs = [1 + (i * 37) % 100 for i in range(100)]  # 1..100, each once, shuffled
    seeded = GoodputPolicy(PARAMS)
    assert seeded.model.short_output() == pytest.approx(PARAMS.out_mean * 0.1)
    for attainment, expected in ((0.9, 10.0), (0.75, 25.0)):
        policy = _policy(attainment=attainment)
        for _ in range(30):
            for out in outputs:
                policy.observe(LatencyObservation("m", "decode", 0.0, output_tokens=out))
        assert policy.model.short_output() == pytest.approx(expected, rel=0.35)
    # a reload keeps it
    fresh = GoodputPolicy(PARAMS)
    fresh.model.inherit(policy.model)
    assert fresh.model.short_output() == policy.model.short_output()
