"""Ask-all's adaptive width: whom to ask, from what the decoders were seen serving."""

from __future__ import annotations

from dataclasses import replace

from pd_orchestrator.config.routing import RoutingConfig
from pd_orchestrator.config.settings import AdaptiveWidthConfig, AskAllFallbackConfig
from pd_orchestrator.model.endpoints import Endpoint, Role
from pd_orchestrator.model.load import Candidate, LoadSnapshot
from pd_orchestrator.model.route import Route, at
from pd_orchestrator.planner.plan import Planner, RequestFacts, Served
from pd_orchestrator.planner.width import AdaptiveWidth, needed_blocks
from pd_orchestrator.policies.base import Leaf, ThresholdContext
from pd_orchestrator.policies.plugins import builtin_registry
from pd_orchestrator.policies.threshold import ThresholdResolver
from pd_orchestrator.prefix.hashing import VllmBlockHasher
from pd_orchestrator.prefix.index import PreciseIndex
from pd_orchestrator.routing.profiles import build_profiles
from pd_orchestrator.routing.types import PrefixFields, RoutingRequest

DECODERS = tuple(Endpoint(f"d{i}", f"http://d{i}:1", Role.DECODE) for i in range(4))
CANDIDATES = [Candidate(d) for d in DECODERS]
SETTLED = AdaptiveWidthConfig(warmup=0.0, explore_every=0, block_tokens=4, chunk_chars=8)


def _ids(conversation: int, length: int) -> tuple[int, ...]:
    return tuple(1000 * conversation + i for i in range(length))


def _request(
    ids: tuple[int, ...], now: float = 100.0, sequence: int = 1, **kw: str
) -> RoutingRequest:
    return RoutingRequest(
        role=Role.DECODE, now=now, model="m", token_ids=ids, sequence=sequence, **kw
    )


def _names(asked: tuple[Endpoint, ...]) -> list[str]:
    return [d.name for d in asked]


def test_threshold_zero_asks_one_decoder_and_a_cold_prompt_asks_none() -> None:
    width = AdaptiveWidth(SETTLED)
    request = _request(_ids(1, 40))
    assert _names(width.asked(request, DECODERS, CANDIDATES, 0.0).decoders) == ["d0"]
    cold = width.asked(request, DECODERS, CANDIDATES, 0.5)
    assert cold.decoders == () and cold.reason == "cold" and cold.blocks == 10


def test_the_decoder_that_served_a_conversation_is_asked_for_its_next_turn_alone() -> None:
    width = AdaptiveWidth(SETTLED)
    turn1 = width.asked(_request(_ids(1, 40)), DECODERS, CANDIDATES, 0.5)
    width.served(turn1.keys, "d2")
    turn2 = width.asked(_request(_ids(1, 60)), DECODERS, CANDIDATES, 0.5)
    assert _names(turn2.decoders) == ["d2"] and turn2.reason == "likely"
    # 40 of 120 tokens held: below 0.5 less a block, so nobody is asked
    turn9 = width.asked(_request(_ids(1, 120)), DECODERS, CANDIDATES, 0.5)
    assert turn9.reason == "cold"
    # a request of another adapter never matches the base model's blocks
    other = width.asked(_request(_ids(1, 60), lora="x"), DECODERS, CANDIDATES, 0.5)
    assert other.reason == "cold"


def test_best_evidence_first_and_one_block_of_slack() -> None:
    width = AdaptiveWidth(SETTLED)
    width.served(width.asked(_request(_ids(1, 20)), DECODERS, CANDIDATES, 0.5).keys, "d3")
    width.served(width.asked(_request(_ids(1, 36)), DECODERS, CANDIDATES, 0.5).keys, "d1")
    # 40 tokens = 10 blocks; 0.5 needs 5, less one: 4; d3 holds 5, d1 holds 9
    asked = width.asked(_request(_ids(1, 40)), DECODERS, CANDIDATES, 0.5)
    assert _names(asked.decoders) == ["d1", "d3"]
    assert needed_blocks(0.5, 10) == 4 and needed_blocks(0.01, 10) == 1


def test_a_rejection_drops_what_it_proved_missing() -> None:
    width = AdaptiveWidth(SETTLED)
    prompt = _request(_ids(1, 40))
    keys = width.asked(prompt, DECODERS, CANDIDATES, 0.5).keys
    width.served(keys, "d0")
    assert _names(width.asked(prompt, DECODERS, CANDIDATES, 0.5).decoders) == ["d0"]
    assert width.rejected(keys, "d0", 0.5, 10) == 7  # blocks 3.. of 10 go
    assert width.asked(prompt, DECODERS, CANDIDATES, 0.5).reason == "cold"
    assert width.index.held(keys, ["d0"]) == {"d0": 3}  # the shared start stays


def test_unknown_decoders_are_asked_until_warmed_up() -> None:
    width = AdaptiveWidth(SETTLED.model_copy(update={"warmup": 30.0}))
    prompt = _ids(1, 40)
    early = width.asked(_request(prompt, now=100.0), DECODERS, CANDIDATES, 0.5)
    assert early.reason == "unknown" and len(early.decoders) == 4
    assert width.report(110.0)["warming_up"] == ["d0", "d1", "d2", "d3"]
    width.served(early.keys, "d1")
    likely = width.asked(_request(prompt, now=110.0), DECODERS, CANDIDATES, 0.5)
    assert _names(likely.decoders) == ["d1", "d0", "d2", "d3"] and likely.reason == "likely"
    later = width.asked(_request(_ids(2, 40), now=131.0), DECODERS, CANDIDATES, 0.5)
    assert later.reason == "cold"


def test_a_decoder_back_from_failed_checks_is_forgotten_and_warms_up_again() -> None:
    width = AdaptiveWidth(SETTLED.model_copy(update={"warmup": 30.0}))
    prompt = _request(_ids(1, 40), now=0.0)
    width.served(width.asked(prompt, DECODERS, CANDIDATES, 0.5).keys, "d1")
    down = [replace(c, healthy=c.endpoint.name != "d1") for c in CANDIDATES]
    width.asked(_request(_ids(2, 40), now=50.0), DECODERS, down, 0.5)
    back = width.asked(_request(_ids(1, 40), now=60.0), DECODERS, CANDIDATES, 0.5)
    assert back.reason == "unknown" and _names(back.decoders) == ["d1"]
    assert width.index.table.size("d1") == 0


def test_one_cold_request_in_explore_every_asks_everyone() -> None:
    width = AdaptiveWidth(SETTLED.model_copy(update={"explore_every": 4}))
    reasons = [
        width.asked(_request(_ids(i, 40), sequence=i), DECODERS, CANDIDATES, 0.5).reason
        for i in range(1, 9)
    ]
    assert reasons == ["cold", "cold", "cold", "explore"] * 2
    assert width.report(0.0)["skipped"] == 6


def test_text_prompts_and_short_prompts() -> None:
    width = AdaptiveWidth(SETTLED)
    text = RoutingRequest(role=Role.DECODE, now=1.0, model="m", prompt="abcdefgh" * 10)
    width.served(width.asked(text, DECODERS, CANDIDATES, 0.5).keys, "d2")
    longer = replace(text, prompt="abcdefgh" * 12)
    assert _names(width.asked(longer, DECODERS, CANDIDATES, 0.5).decoders) == ["d2"]
    short = replace(text, prompt="abc")
    assert width.asked(short, DECODERS, CANDIDATES, 0.5).reason == "short"


def test_past_max_blocks_a_decoder_holding_every_hashed_block_is_likely() -> None:
    width = AdaptiveWidth(SETTLED.model_copy(update={"max_blocks": 5}))
    first = width.asked(_request(_ids(1, 400)), DECODERS, CANDIDATES, 0.9)
    assert len(first.keys) == 5 and first.blocks == 100
    width.served(first.keys, "d0")
    again = width.asked(_request(_ids(1, 400)), DECODERS, CANDIDATES, 0.9)
    assert _names(again.decoders) == ["d0"]


def test_the_precise_index_counts_as_evidence() -> None:
    index = PreciseIndex(VllmBlockHasher(4))
    ids = _ids(3, 40)
    keys = index.keys(ids)
    assert keys
    index.table.add("d3", keys)  # as if d3's KV events had stored them
    width = AdaptiveWidth(SETTLED, precise=index)
    assert _names(width.asked(_request(ids), DECODERS, CANDIDATES, 0.5).decoders) == ["d3"]


class _Half(Leaf):
    name = "static"
    bounds = (0.5, 0.5)

    def decide(self, context: ThresholdContext) -> Route:
        return at(0.5, "static", "fixed")

    def observe(self, observation: object) -> None:
        return None


def test_the_planner_skips_the_fan_out_then_learns_where_the_prompt_went() -> None:
    profiles = build_profiles(RoutingConfig(), builtin_registry())
    resolver = ThresholdResolver(_Half())  # type: ignore[arg-type]
    adaptive = AdaptiveWidth(SETTLED)
    planner = Planner(profiles, resolver, width="adaptive", adaptive=adaptive)
    busy = LoadSnapshot(running=9, waiting=0, kv_usage=0.1, observed_at=0.0)
    candidates = [Candidate(d, load=busy if d.name != "d2" else None) for d in DECODERS]
    candidates.append(Candidate(Endpoint("p0", "http://p0:1", Role.PREFILL)))
    facts = RequestFacts("m", 160, fields=PrefixFields(token_ids=_ids(5, 40)))
    plan = planner.plan(facts, candidates, 1.0, 1)
    assert plan.asked == () and plan.width is not None and plan.width.reason == "cold"
    # with nobody asked, the fallback is the best of every decoder (d2: least loaded)
    assert plan.fallback(AskAllFallbackConfig()).name == "d2"
    planner.learn(plan, facts, Served(DECODERS[2], 2.0))
    warm = planner.plan(facts, candidates, 3.0, 2)
    assert _names(warm.asked) == ["d2"]
    planner.learn(warm, facts, Served(DECODERS[0], 4.0, rejected=("d2",)))
    again = planner.plan(facts, candidates, 5.0, 3)
    assert _names(again.asked) == ["d0"]  # d2 proved it lost the prompt; d0 took it


def _queried(count: float, *, only: str | None = None) -> list[Candidate]:
    load = LoadSnapshot(running=0, waiting=0, kv_usage=0.0, observed_at=0.0, prefix_queries=count)
    return [replace(c, load=load) if only in (None, c.endpoint.name) else c for c in CANDIDATES]


def test_a_fresh_decoder_is_known_at_once_and_a_restart_is_forgotten() -> None:
    width = AdaptiveWidth(SETTLED.model_copy(update={"warmup": 30.0}))
    fresh = width.asked(_request(_ids(1, 40), now=0.0), DECODERS, _queried(0), 0.5)
    assert fresh.reason == "cold"  # every cache is empty: nobody to ask, no warm-up
    width.served(fresh.keys, "d1")
    warm = _queried(5000)
    assert _names(width.asked(_request(_ids(1, 40), now=1.0), DECODERS, warm, 0.5).decoders) == [
        "d1"
    ]
    restarted = _queried(12, only="d1")  # d1's counter went down: it restarted
    after = width.asked(_request(_ids(1, 40), now=2.0), DECODERS, restarted, 0.5)
    assert after.reason == "unknown" and _names(after.decoders) == ["d1"]
    assert width.index.table.size("d1") == 0


def test_exploring_asks_explore_width_decoders_each_in_turn() -> None:
    config = SETTLED.model_copy(update={"explore_every": 2, "explore_width": 3})
    width = AdaptiveWidth(config)
    explored = [
        _names(width.asked(_request(_ids(i, 40), sequence=i), DECODERS, CANDIDATES, 0.5).decoders)
        for i in range(0, 8, 2)
    ]
    assert explored == [
        ["d0", "d1", "d2"],
        ["d3", "d0", "d1"],
        ["d2", "d3", "d0"],
        ["d1", "d2", "d3"],
    ]
    everyone = AdaptiveWidth(config.model_copy(update={"explore_width": 0}))
    assert (
        len(everyone.asked(_request(_ids(1, 40), sequence=0), DECODERS, CANDIDATES, 0.5).decoders)
        == 4
    )
