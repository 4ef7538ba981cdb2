"""The planner over the routing pipeline, the ask-all fallback pick, threshold resolution."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import pytest

from pd_orchestrator.config.routing import RoutingConfig
from pd_orchestrator.config.settings import AskAllFallbackConfig
from pd_orchestrator.model.endpoints import Endpoint, Role
from pd_orchestrator.model.load import Candidate, LoadSnapshot
from pd_orchestrator.model.route import Ask, Decline, GoPD, Local, Route, Whole, at, threshold_of
from pd_orchestrator.planner.choices import pick_fallback
from pd_orchestrator.planner.plan import NoCandidateError, Planner, PrefillRanking, RequestFacts
from pd_orchestrator.policies.base import ThresholdContext
from pd_orchestrator.policies.plugins import builtin_registry
from pd_orchestrator.policies.threshold import ThresholdResolver
from pd_orchestrator.routing.profiles import build_profiles
from pd_orchestrator.routing.types import RoutingRequest


def _endpoint(name: str, role: Role, group: str, hardware: str = "h200", **kw: Any) -> Endpoint:
    return Endpoint(name, f"http://{name}:1", role, hardware=hardware, group=group, **kw)


FLEET = [
    _endpoint("hd0", Role.DECODE, "nvidia"),
    _endpoint("hd1", Role.DECODE, "nvidia"),
    _endpoint("ad0", Role.DECODE, "amd", "mi325x"),
    _endpoint("hp0", Role.PREFILL, "nvidia"),
    _endpoint("ap0", Role.PREFILL, "amd", "mi325x"),
    _endpoint("ap-example", Role.PREFILL, "amd", "mi325x", connector="example"),
]


def _request(prompt: str = "hello") -> RequestFacts:
    return RequestFacts(model="m", prompt_chars=len(prompt), affinity_key=prompt)


class _Fixed:
    """A policy that always answers 0.5 and remembers what it was shown; it reads the
    context's prefillers when ``reads_prefillers``, its peers when ``reads_peers``, the
    decoder's cached tokens when ``reads_cache`` (a read is worked out when asked)."""

    name = "static"
    bounds = (0.0, 1.0)
    parts = ()
    ranks_spill = False
    observes = False
    reads_cache = False

    def __init__(self, reads_prefillers: bool = True, reads_peers: bool = False) -> None:
        self.seen: list[ThresholdContext] = []
        self.reads_prefillers = reads_prefillers
        self.reads_peers = reads_peers
        self.told: list[Route] = []

    def decide(self, context: ThresholdContext) -> Route:
        self.seen.append(context)
        if self.reads_prefillers:
            assert context.prefillers is not None
        if self.reads_peers:
            assert context.peers is not None
        if self.reads_cache:
            context.cached_tokens  # noqa: B018 - the read is the point
        return self.answer(context)

    def answer(self, context: ThresholdContext) -> Route:
        return at(0.5, "static", "fixed")

    def chosen(self, context: ThresholdContext, route: Route) -> None:
        self.told.append(route)

    def observe(self, observation: object) -> None:
        return None


def _planner(
    pairs: frozenset[tuple[str, str]] = frozenset(), policy: _Fixed | None = None
) -> Planner:
    resolver = ThresholdResolver(policy or _Fixed())  # type: ignore[arg-type]
    return Planner(build_profiles(RoutingConfig(), builtin_registry()), resolver, pairs)


def test_plan_ranks_only_decoders_and_asks_the_threshold() -> None:
    candidates = [Candidate(e) for e in FLEET]
    policy = _Fixed()
    plan = _planner(policy=policy).plan(_request(), candidates, 0.0, 0)
    assert {e.name for e in plan.decoders} == {"hd0", "hd1", "ad0"}
    assert threshold_of(plan.route) == 0.5
    [context] = policy.seen  # asked once, about the first decoder and its prefillers
    assert context.decoder.endpoint == plan.decoder
    assert {c.endpoint.name for c in context.prefillers} == {
        e.name for e in plan.prefillers_for(plan.decoder)
    }


def test_a_policy_that_reads_no_prefillers_costs_no_prefill_ranking() -> None:
    policy = _Fixed(reads_prefillers=False)
    plan = _planner(policy=policy).plan(_request(), [Candidate(e) for e in FLEET], 0.0, 0)
    [context] = policy.seen
    assert not plan.prefillers._cache  # the policy never asked
    assert {e.name for e in plan.prefillers_for(plan.decoder)}  # ranked when asked for
    assert {c.endpoint.name for c in context.prefillers} == {"hp0"}  # and in the context


def test_busy_decoders_rank_last() -> None:
    busy = LoadSnapshot(running=30, waiting=10, kv_usage=0.9, observed_at=0.0)
    idle = LoadSnapshot(running=0, waiting=0, kv_usage=0.1, observed_at=0.0)
    candidates = [Candidate(e, load=busy if e.name != "ad0" else idle) for e in FLEET]
    assert _planner().plan(_request(), candidates, 0.0, 0).decoder.name == "ad0"


def test_no_healthy_decoder_is_an_error_naming_the_filter() -> None:
    candidates = [Candidate(e, healthy=e.role is Role.PREFILL) for e in FLEET]
    strict = RoutingConfig.model_validate(
        {"decode": {"filters": [{"type": "healthy", "params": {"panic": False}}]}}
    )
    planner = Planner(build_profiles(strict, builtin_registry()), ThresholdResolver(_Fixed()))  # type: ignore[arg-type]
    with pytest.raises(NoCandidateError, match="healthy dropped 3"):
        planner.plan(_request(), candidates, 0.0, 0)


def test_when_no_decoder_looks_healthy_the_plan_keeps_them_all() -> None:
    candidates = [Candidate(e, healthy=e.role is Role.PREFILL) for e in FLEET]
    plan = _planner().plan(_request(), candidates, 0.0, 0)
    assert {e.name for e in plan.decoders} == {"hd0", "hd1", "ad0"}


def test_spare_decoders_are_the_ranking_with_health_set_aside() -> None:
    out = {"hd1", "ad0"}
    candidates = [Candidate(e, healthy=e.name not in out) for e in FLEET]
    plan = _planner().plan(_request(), candidates, 0.0, 0)
    assert [e.name for e in plan.decoders] == ["hd0"]
    assert {e.name for e in plan.spare_decoders()} == {"hd0", "hd1", "ad0"}


def test_the_plan_sizes_the_prompt() -> None:
    counted = RequestFacts(model="m", prompt_chars=400, prompt_tokens=123)
    candidates = [Candidate(e) for e in FLEET]
    assert _planner().plan(counted, candidates, 0.0, 0).prompt_tokens == 123
    estimated = RequestFacts(model="m", prompt_chars=400)  # the prior: 4 characters a token
    assert _planner().plan(estimated, candidates, 0.0, 0).prompt_tokens == 100
    decode_only = Planner(build_profiles(RoutingConfig(), builtin_registry()))
    assert decode_only.plan(estimated, candidates, 0.0, 0).prompt_tokens == 100


@pytest.mark.parametrize(
    ("decoder", "pairs", "expected"),
    [
        ("hd0", frozenset(), {"hp0"}),
        ("ad0", frozenset(), {"ap0"}),
        ("ad0", frozenset({("nvidia", "amd")}), {"ap0", "hp0"}),
        ("hd0", frozenset({("nvidia", "amd")}), {"hp0"}),
    ],
    ids=["same-group", "other-group", "host-staged-pair", "pairs-are-directed"],
)
def test_prefillers_keep_the_decoder_group_and_connector(
    decoder: str, pairs: frozenset[tuple[str, str]], expected: set[str]
) -> None:
    candidates = [Candidate(e) for e in FLEET]
    chosen = next(e for e in FLEET if e.name == decoder)
    plan = _planner(pairs).plan(_request(), candidates, 0.0, 0)
    assert {e.name for e in plan.prefillers_for(chosen)} == expected


@pytest.mark.parametrize(
    ("pick", "expected"),
    [("least-loaded", "b"), ("most-free-kv", "c"), ("hardware-weight", "c")],
)
def test_fallback_pick(pick: str, expected: str) -> None:
    loads = {
        "a": LoadSnapshot(running=4, waiting=2, kv_usage=0.5, observed_at=0.0),
        "b": LoadSnapshot(running=1, waiting=0, kv_usage=0.8, observed_at=0.0),
        "c": LoadSnapshot(running=3, waiting=0, kv_usage=0.2, observed_at=0.0),
    }
    endpoints = {
        "a": _endpoint("a", Role.DECODE, "g"),
        "b": _endpoint("b", Role.DECODE, "g"),
        "c": _endpoint("c", Role.DECODE, "g", hardware="mi325x"),
    }
    candidates = [Candidate(endpoints[n], load=loads[n]) for n in "abc"]
    config = AskAllFallbackConfig(pick=pick, hardware_weights={"mi325x": 2.0})  # type: ignore[arg-type]
    assert pick_fallback(list(endpoints.values()), candidates, config).name == expected


def test_fallback_ties_keep_the_plan_order() -> None:
    endpoints = [_endpoint(n, Role.DECODE, "g") for n in ("z", "y", "x")]
    candidates = [Candidate(e) for e in endpoints]
    assert pick_fallback(endpoints, candidates, AskAllFallbackConfig()).name == "z"


def test_fallback_ties_take_turns_in_fleet_order() -> None:
    endpoints = [_endpoint(n, Role.DECODE, "g") for n in ("z", "y", "x", "w")]
    candidates = [Candidate(e) for e in endpoints]
    asked = [endpoints[2], endpoints[0], endpoints[3], endpoints[1]]  # the plan's order
    config = AskAllFallbackConfig()
    picks = [pick_fallback(asked, candidates, config, ordinal).name for ordinal in range(8)]
    assert picks == ["z", "y", "x", "w"] * 2


def _round_robin() -> Planner:
    routing = RoutingConfig.model_validate(
        {"decode": {"scorers": [], "picker": {"type": "max-score", "params": {"ties": "rotate"}}}}
    )
    return Planner(build_profiles(routing, builtin_registry()), ThresholdResolver(_Fixed()))  # type: ignore[arg-type]


def test_round_robin_visits_every_decoder_in_turn() -> None:
    decoders = [_endpoint(f"d{i}", Role.DECODE, "g") for i in range(4)]
    fleet = [Candidate(e) for e in [*decoders, _endpoint("p0", Role.PREFILL, "g")]]
    planner = _round_robin()
    picks = [planner.plan(_request(f"p{n}"), fleet, 0.0, n).decoder.name for n in range(400)]
    assert {name: picks.count(name) for name in set(picks)} == {f"d{i}": 100 for i in range(4)}
    assert picks[:5] == ["d0", "d1", "d2", "d3", "d0"]


def test_every_profile_run_of_a_request_shares_its_ordinal() -> None:
    decoders = [_endpoint(f"d{i}", Role.DECODE, "g") for i in range(2)]
    prefillers = [_endpoint(f"p{i}", Role.PREFILL, "g") for i in range(2)]
    routing = RoutingConfig.model_validate(
        {
            "decode": {
                "scorers": [],
                "picker": {"type": "max-score", "params": {"ties": "rotate"}},
            },
            "prefill": {
                "scorers": [],
                "picker": {"type": "max-score", "params": {"ties": "rotate"}},
            },
        }
    )
    planner = Planner(build_profiles(routing, builtin_registry()), ThresholdResolver(_Fixed()))  # type: ignore[arg-type]
    fleet = [Candidate(e) for e in [*decoders, *prefillers]]
    for n in range(4):
        plan = planner.plan(_request(), fleet, 0.0, n)
        assert plan.ordinal == n and plan.decoder.name == f"d{n % 2}"
        assert plan.prefillers_for(plan.decoder)[0].name == f"p{n % 2}"


def test_the_fallback_prefers_a_partial_holder_within_the_slack() -> None:
    endpoints = [_endpoint(n, Role.DECODE, "nvidia") for n in ("a", "b", "c")]

    def loaded(depth: int) -> LoadSnapshot:
        return LoadSnapshot(running=depth, waiting=0, kv_usage=0.1, observed_at=0.0)

    candidates = [Candidate(e, load=loaded(d)) for e, d in zip(endpoints, (0, 2, 3), strict=True)]
    config = AskAllFallbackConfig()  # least-loaded, holder_slack 2
    assert pick_fallback(endpoints, candidates, config).name == "a"
    assert pick_fallback(endpoints, candidates, config, prefer=("c", "b")).name == "b"
    assert pick_fallback(endpoints, candidates, config, prefer=("c",)).name == "a"
    strict = AskAllFallbackConfig(holder_slack=0)
    assert pick_fallback(endpoints, candidates, strict, prefer=("b",)).name == "a"


def _loaded(endpoint: Endpoint, admission_only: bool) -> Candidate:
    load = LoadSnapshot(0, 0, 0.1, 0.0, admission_only=admission_only)
    return Candidate(endpoint, load=load, admission_only=admission_only)


def _constrained() -> RequestFacts:
    return RequestFacts(model="m", prompt_chars=5, affinity_key="tools", continuable=False)


def test_a_constrained_request_gets_the_policy_threshold_admission_only() -> None:
    candidates = [_loaded(e, admission_only=True) for e in FLEET]
    plan = _planner().plan(_constrained(), candidates, 0.0, 0)
    assert plan.route == Ask(0.5, "static", "fixed", admission_only=True)
    continuable = _planner().plan(_request(), candidates, 0.0, 0).route
    assert continuable.admission_only is False


def test_a_constrained_request_gets_zero_where_a_decoder_cannot_take_admission_only() -> None:
    older = {"hd0", "hd1", "ad0"}  # no decoder says it takes it (or its metrics are unread)
    candidates = [_loaded(e, admission_only=e.name not in older) for e in FLEET]
    plan = _planner().plan(_constrained(), candidates, 0.0, 0)
    assert (threshold_of(plan.route), plan.route.reason) == (0.0, "not-continuable")
    assert not plan.route.admission_only
    unread = [Candidate(e) for e in FLEET]
    assert _planner().plan(_constrained(), unread, 0.0, 0).route.reason == "not-continuable"


def test_ask_all_takes_admission_only_only_when_every_decoder_does() -> None:
    resolver = ThresholdResolver(_Fixed())  # type: ignore[arg-type]
    profiles = build_profiles(RoutingConfig(), builtin_registry())
    ask_all = Planner(profiles, resolver, width="all")
    every = [_loaded(e, admission_only=True) for e in FLEET]
    assert ask_all.plan(_constrained(), every, 0.0, 0).route.admission_only
    one_older = [_loaded(e, admission_only=e.name != "ad0") for e in FLEET]
    assert ask_all.plan(_constrained(), one_older, 0.0, 0).route.reason == "not-continuable"


def test_an_endpoint_of_role_both_never_prefills_for_itself() -> None:
    both = [_endpoint(f"b{i}", Role.BOTH, "nvidia") for i in range(3)]
    policy = _Fixed()
    plan = _planner(policy=policy).plan(_request(), [Candidate(e) for e in both], 0.0, 0)
    decoder = plan.decoder
    others = {e.name for e in both} - {decoder.name}
    assert {e.name for e in plan.prefillers_for(decoder)} == others
    [seen] = policy.seen
    assert {c.endpoint.name for c in seen.prefillers} == others
    for endpoint in both:  # the ranking is worked out once; each decoder is left out of its own
        assert endpoint.name not in {e.name for e in plan.prefillers_for(endpoint)}


def test_admission_only_is_kept_while_the_reading_is_stale() -> None:
    """A decoder too busy to answer its ``/metrics`` in time has a stale reading (no
    load), but its plugin still honours admission-only: the constrained request keeps
    the policy's threshold."""
    stale = [Candidate(e, load=None, admission_only=True) for e in FLEET]
    plan = _planner().plan(_constrained(), stale, 0.0, 0)
    assert plan.route == Ask(0.5, "static", "fixed", admission_only=True)
    unknown = [Candidate(e) for e in FLEET]  # never read: not known to honour it
    assert threshold_of(_planner().plan(_constrained(), unknown, 0.0, 0).route) == 0.0


def _structured() -> RequestFacts:
    return RequestFacts(
        model="m", prompt_chars=5, affinity_key="json", continuable=False, resumable=True
    )


def test_a_structured_output_is_continuable_where_its_decoder_and_prefillers_resume() -> None:
    """Sent with the policy's threshold as it is (a hand-back continues it) when the
    decoder and every prefiller that can reach it advance grammars; admission-only as
    soon as one of them does not (a continuation's prefill leg carries the grammar)."""
    every = [Candidate(e, admission_only=True, resumes=True) for e in FLEET]
    plan = _planner().plan(_structured(), every, 0.0, 0)
    assert plan.continuable and plan.route == at(0.5, "static", "fixed")
    decoder = plan.decoder.name
    reach = {e.name for e in plan.prefillers_for(plan.decoder)}
    for older in (decoder, *reach):
        some = [replace(c, resumes=c.endpoint.name != older) for c in every]
        plan = _planner().plan(_structured(), some, 0.0, 0)
        assert not plan.continuable and plan.route.admission_only, older
    unreachable = {e.name for e in FLEET if e.role is Role.PREFILL} - reach
    for other in unreachable:  # a prefiller that cannot reach the decoder does not count
        some = [replace(c, resumes=c.endpoint.name != other) for c in every]
        assert _planner().plan(_structured(), some, 0.0, 0).continuable


class _Drain(_Fixed):
    """A policy that sends every prompt P/D at once, to decode on ``decoder``."""

    def __init__(self, decoder: str | None) -> None:
        super().__init__(reads_peers=True)
        self.decoder = decoder

    def answer(self, context: ThresholdContext) -> Route:
        return GoPD("goodput", "drain", self.decoder)


def test_a_request_sent_p_d_at_once_decodes_where_the_policy_names() -> None:
    more = [*FLEET, _endpoint("hd2", Role.DECODE, "nvidia")]
    candidates = [Candidate(e, in_flight=0 if e.name == "hd2" else 2) for e in more]
    policy = _Drain("hd1")
    plan = _planner(policy=policy).plan(_request(), candidates, 0.0, 0)
    [seen] = policy.seen
    chosen = seen.decoder.endpoint.name
    assert chosen == "hd2"  # the least busy
    # the peers: the other ranked decoders the same prefillers reach, never the AMD one
    assert [c.endpoint.name for c in seen.peers] == ["hd0", "hd1"]
    assert [c.in_flight for c in seen.peers] == [2, 2]  # with what the fleet knows of them
    assert plan.decoder.name == "hd1" and plan.asked[0].name == "hd1"
    assert {e.name for e in plan.decoders} == {"hd0", "hd1", "hd2", "ad0"}
    assert {e.name for e in plan.prefillers_for(plan.decoder)} == {"hp0"}
    # a name the plan does not rank changes nothing
    elsewhere = _planner(policy=_Drain("nowhere")).plan(_request(), candidates, 0.0, 0)
    assert elsewhere.decoder.name == chosen


class _Spill(_Fixed):
    """A policy that serves every prompt whole (threshold 0) on ``target``."""

    def __init__(self, target: str) -> None:
        super().__init__()
        self.target = target

    def answer(self, context: ThresholdContext) -> Route:
        return Whole("goodput", "spill", self.target)


def test_a_prompt_served_whole_on_a_spilling_prefiller_leads_the_plan_with_it() -> None:
    spilling = _endpoint("hp1", Role.PREFILL, "nvidia", spill=True)
    candidates = [Candidate(e) for e in (*FLEET, spilling)]
    plan = _planner(policy=_Spill("hp1")).plan(_request(), candidates, 0.0, 0)
    assert plan.decoder is spilling and plan.asked[0] is spilling
    assert threshold_of(plan.route) == 0.0
    # the ranked decoders follow it, for an attempt that fails there
    assert [e.name for e in plan.decoders[1:]] == ["hd0", "hd1", "ad0"]
    # a prefiller whose pool does not spill is never a decoder, whatever a policy names
    plain = _planner(policy=_Spill("hp0")).plan(_request(), candidates, 0.0, 0)
    assert plain.decoder.name == "hd0" and all(e.role.decodes for e in plain.decoders)


def test_an_endpoint_that_also_prefills_is_a_prefiller_for_the_others_of_its_class() -> None:
    both = [_endpoint(f"hb{i}", Role.BOTH, "nvidia") for i in range(3)]
    profile = build_profiles(RoutingConfig(), builtin_registry()).prefill
    ranking = PrefillRanking(
        profile, RoutingRequest(Role.DECODE, 0.0), tuple(Candidate(e) for e in both),
        frozenset(), frozenset(), None,
    )  # fmt: skip
    # each ranking leaves out its own decoder only: the class's first ranking, worked
    # out for hb0, does not stand for hb1's
    for endpoint in both:
        assert {e.name for e in ranking.for_decoder(endpoint)} == {
            e.name for e in both if e is not endpoint
        }


class _Whole(_Fixed):
    """A policy that reads spill: a spilling prefiller it is asked about serves the
    request whole (0) when ``takes``, else declines it (1); a decoder gets 0.5."""

    ranks_spill = True

    def __init__(self, takes: bool) -> None:
        super().__init__(reads_peers=True)
        self.takes = takes

    def answer(self, context: ThresholdContext) -> Route:
        if not context.decoder.endpoint.spill:
            return at(0.5, "static", "fixed")
        if self.takes:
            return Local("goodput", "spill")
        return Decline("goodput", "declined")


def test_spilling_prefillers_rank_beside_the_decoders_for_a_policy_that_reads_them() -> None:
    spilling = _endpoint("hp1", Role.PREFILL, "nvidia", spill=True)
    fleet = (*FLEET, spilling)
    candidates = [Candidate(e, in_flight=0 if e is spilling else 2) for e in fleet]
    decoders = {"hd0", "hd1", "ad0"}
    takes = _Whole(takes=True)
    plan = _planner(policy=takes).plan(_request(), candidates, 0.0, 0)
    # the least busy is the spilling prefiller: the policy is asked about it, and it
    # serves the request whole, the ranked decoders after it
    [seen] = takes.seen
    assert seen.decoder.endpoint is spilling
    assert {c.endpoint.name for c in seen.peers} <= decoders  # never another prefiller
    assert plan.decoder is spilling and plan.asked[0] is spilling
    assert threshold_of(plan.route) == 0.0
    assert {e.name for e in plan.decoders[1:]} == decoders
    # it declines: the decoders alone are ranked, and the policy decides for their pick
    declines = _Whole(takes=False)
    plan = _planner(policy=declines).plan(_request(), candidates, 0.0, 0)
    first, then = declines.seen
    assert first.decoder.endpoint is spilling and then.decoder.endpoint is plan.decoder
    assert threshold_of(plan.route) == 0.5 and {e.name for e in plan.decoders} == decoders
    # a policy that does not read them, and ask-all, never see a prefiller ranked
    plain = _Fixed()
    plan = _planner(policy=plain).plan(_request(), candidates, 0.0, 0)
    assert {e.name for e in plan.decoders} == decoders
    assert all(c.decoder.endpoint.role.decodes for c in plain.seen)
    wide = _Whole(takes=True)
    resolver = ThresholdResolver(wide)  # type: ignore[arg-type]
    profiles = build_profiles(RoutingConfig(), builtin_registry())
    plan = Planner(profiles, resolver, width="all").plan(_request(), candidates, 0.0, 0)
    assert {e.name for e in plan.decoders} == decoders


def test_the_policy_is_told_what_each_pick_it_decided_took() -> None:
    spilling = _endpoint("hp1", Role.PREFILL, "nvidia", spill=True)
    candidates = [Candidate(e, in_flight=0 if e is spilling else 2) for e in (*FLEET, spilling)]
    declines = _Whole(takes=False)
    plan = _planner(policy=declines).plan(_request(), candidates, 0.0, 0)
    assert len(declines.seen) == 2  # asked about the spilling pick, then a decoder
    # the declined pick, then the decoder's final route
    assert declines.told == [Decline("goodput", "declined"), plan.route]
    assert plan.route == Ask(0.5, "static", "fixed")


def test_ask_all_sees_no_peers() -> None:
    policy = _Fixed(reads_peers=True)
    resolver = ThresholdResolver(policy)  # type: ignore[arg-type]
    ask_all = Planner(build_profiles(RoutingConfig(), builtin_registry()), resolver, width="all")
    ask_all.plan(_request(), [Candidate(e) for e in FLEET], 0.0, 0)
    _planner(policy=policy).plan(_request(), [Candidate(e) for e in FLEET], 0.0, 0)
    ask_all_seen, decode_first_seen = policy.seen
    assert ask_all_seen.peers == () and decode_first_seen.peers  # decode-first: one peer


class _Cache:
    """A :class:`~pd_orchestrator.planner.plan.CachedPrefix` that holds ``held``
    tokens of every prompt on every decoder, and counts its calls."""

    def __init__(self, held: int | None) -> None:
        self.held = held
        self.asked: list[tuple[str | None, str]] = []

    def cached_tokens(self, request: RoutingRequest, decoder: Endpoint) -> int | None:
        self.asked.append((request.affinity_key, decoder.name))
        return self.held

    def blocks(self, request: RoutingRequest) -> tuple[int, ...]:
        return (7, 8) if request.affinity_key == "k" else ()


class _ReadsCache(_Fixed):
    reads_cache = True


def test_a_policy_that_reads_the_cache_sees_the_decoder_s_cached_prefix() -> None:
    counted = RequestFacts(model="m", prompt_chars=400, prompt_tokens=100, affinity_key="k")
    candidates = [Candidate(e) for e in FLEET]
    profiles = build_profiles(RoutingConfig(), builtin_registry())

    def seen(policy: _Fixed, cache: _Cache) -> int | None:
        planner = Planner(profiles, ThresholdResolver(policy), cache=cache)  # type: ignore[arg-type]
        plan = planner.plan(counted, candidates, 0.0, 0)
        assert not cache.asked or cache.asked == [("k", plan.decoder.name)]
        return policy.seen[-1].cached_tokens

    assert seen(_ReadsCache(), _Cache(64)) == 64
    assert seen(_ReadsCache(), _Cache(None)) is None  # the index cannot tell
    assert seen(_ReadsCache(), _Cache(500)) == 100  # never more than the prompt
    blind, cache = _Fixed(), _Cache(64)
    planner = Planner(profiles, ThresholdResolver(blind), cache=cache)  # type: ignore[arg-type]
    planner.plan(counted, candidates, 0.0, 0)
    assert not cache.asked  # the policy reads no cache: never asked


def test_the_plan_carries_the_prompt_s_blocks_when_the_planner_has_a_cache() -> None:
    """The legs hold the plan's block keys pending on the endpoint that prefills, for
    the cache's counts a policy may read; without a cache there are none."""
    counted = RequestFacts(model="m", prompt_chars=400, prompt_tokens=100, affinity_key="k")
    candidates = [Candidate(e) for e in FLEET]
    profiles = build_profiles(RoutingConfig(), builtin_registry())

    def blocks(policy: _Fixed, cache: _Cache | None) -> Sequence[int]:
        planner = Planner(profiles, ThresholdResolver(policy), cache=cache)  # type: ignore[arg-type]
        return planner.plan(counted, candidates, 0.0, 0).blocks

    assert blocks(_ReadsCache(), _Cache(64)) == (7, 8)
    assert blocks(_Fixed(), _Cache(64)) == (7, 8)
    assert blocks(_ReadsCache(), None) == ()


def test_a_policy_that_reads_the_cache_may_ask_it_of_a_prefiller_too() -> None:
    counted = RequestFacts(model="m", prompt_chars=400, prompt_tokens=100, affinity_key="k")
    policy, cache = _ReadsCache(), _Cache(500)
    planner = Planner(
        build_profiles(RoutingConfig(), builtin_registry()),
        ThresholdResolver(policy),  # type: ignore[arg-type]
        cache=cache,
    )
    planner.plan(counted, [Candidate(e) for e in FLEET], 0.0, 0)
    context = policy.seen[-1]
    cache.asked.clear()
    assert context.cached_on(FLEET[3]) == 100  # never more than the prompt
    assert cache.asked == [("k", "hp0")]  # asked only when the policy asks


class _Naming(_Fixed):
    """Answers a threshold that names ``prefiller`` for the P/D leg."""

    def __init__(self, prefiller: str | None, threshold: float = 0.5) -> None:
        super().__init__()
        self.prefiller, self.threshold = prefiller, threshold

    def answer(self, context: ThresholdContext) -> Route:
        return at(self.threshold, "static", "fixed", self.prefiller)


@pytest.mark.parametrize("threshold", [0.5, 1.0])
def test_the_p_d_leg_goes_first_to_the_prefiller_the_route_names(threshold: float) -> None:
    decoders = [_endpoint("d0", Role.DECODE, "g")]
    prefillers = [_endpoint(f"p{i}", Role.PREFILL, "g") for i in range(3)]
    fleet = [Candidate(e) for e in [*decoders, *prefillers]]
    plain = _planner().plan(_request(), fleet, 0.0, 0)
    ranked = [e.name for e in plain.prefillers_for(decoders[0])]
    named = ranked[-1]
    plan = _planner(policy=_Naming(named, threshold)).plan(_request(), fleet, 0.0, 0)
    assert isinstance(plan.route, Ask | GoPD) and plan.route.prefiller == named
    # the named one first, the others in the ranking's order (the next attempts)
    assert [e.name for e in plan.prefillers_for(plan.decoder)] == [named, *ranked[:-1]]


def test_a_named_prefiller_that_cannot_reach_the_decoder_changes_nothing() -> None:
    candidates = [Candidate(e) for e in FLEET]
    plain = _planner().plan(_request(), candidates, 0.0, 0)
    plan = _planner(policy=_Naming("ap0")).plan(_request(), candidates, 0.0, 0)
    assert plan.decoder.group == "nvidia"  # ap0 is in the amd group
    assert plan.prefillers_for(plan.decoder) == plain.prefillers_for(plain.decoder)
