"""The planner tells the threshold policy whether a served request's prefill waited
behind a queue (its TTFT then times the queue too, and no rate learns from it),
whether it ran alone on its endpoint (its TTFT then measures the engine) and how
many streams its decoder ran when it was planned (the batch its ITL was timed in)."""

from __future__ import annotations

from pd_orchestrator.config.routing import RoutingConfig
from pd_orchestrator.model.endpoints import Endpoint, Role
from pd_orchestrator.model.load import Candidate, LoadSnapshot
from pd_orchestrator.model.route import Route, at
from pd_orchestrator.planner.plan import Planner, RequestFacts, Served
from pd_orchestrator.policies.base import LatencyObservation, Leaf, ThresholdContext
from pd_orchestrator.policies.plugins import builtin_registry
from pd_orchestrator.policies.threshold import ThresholdResolver
from pd_orchestrator.routing.profiles import build_profiles


class _Recorder(Leaf):
    __slots__ = ("observes", "seen")
    name = "recorder"
    bounds = (0.5, 0.5)

    def __init__(self, observes: bool = True) -> None:
        self.observes = observes
        self.seen: list[LatencyObservation] = []

    def decide(self, context: ThresholdContext) -> Route:
        return at(0.5, "recorder", "fixed")

    def observe(self, observation: LatencyObservation) -> None:
        self.seen.append(observation)


def _endpoint(name: str, role: Role) -> Endpoint:
    return Endpoint(name, f"http://{name}:1", role)


D_BACKLOG, D_IDLE, D_WAITING, D_UNREAD, D_QUIET, D_OWN, D_LEFT, D_OTHER = (
    _endpoint(f"d{i}", Role.DECODE) for i in range(8)
)
P_BUSY, P_IDLE, P_QUIET = (_endpoint(f"p{i}", Role.PREFILL) for i in range(3))
QUIET = LoadSnapshot(running=0, waiting=0, kv_usage=0.0, observed_at=0.0)
WAITING = LoadSnapshot(running=4, waiting=2, kv_usage=0.3, observed_at=0.0)
RUNNING = LoadSnapshot(running=4, waiting=0, kv_usage=0.3, observed_at=0.0)
LEFT = LoadSnapshot(running=1, waiting=0, kv_usage=0.1, observed_at=0.0, counted=1)
OTHER = LoadSnapshot(running=2, waiting=0, kv_usage=0.1, observed_at=0.0, counted=1)


def _observed(served: Served) -> LatencyObservation:
    recorder = _Recorder()
    _learn(recorder, served)
    (observation,) = recorder.seen
    return observation


def _learn(recorder: _Recorder, served: Served) -> None:
    planner = Planner(
        build_profiles(RoutingConfig(), builtin_registry()),
        ThresholdResolver(recorder),
    )
    candidates = [
        Candidate(D_BACKLOG, in_flight=6, backlog=3_000),
        Candidate(D_IDLE, load=RUNNING),
        Candidate(D_WAITING, load=WAITING),
        Candidate(P_BUSY, backlog=8_000),
        Candidate(P_IDLE),
        Candidate(D_QUIET, load=QUIET),
        Candidate(D_OWN, in_flight=1, load=QUIET),  # the reading missed one of its own
        Candidate(P_QUIET, load=QUIET),
        Candidate(D_LEFT, load=LEFT),  # read while one of the gateway's ran, since gone
        Candidate(D_OTHER, load=OTHER),  # and another's beside it
    ]
    facts = RequestFacts("m", 400)
    plan = planner.plan(facts, candidates, 1.0, 1)
    planner.learn(plan, facts, served)


def _queued(served: Served) -> bool | None:
    return _observed(served).queued


def test_a_local_sample_is_queued_when_its_decoder_had_tokens_or_requests_waiting() -> None:
    assert _queued(Served(D_BACKLOG, 2.0, ttft=0.5, remote=False)) is True
    assert _queued(Served(D_WAITING, 2.0, ttft=0.5, remote=False)) is True
    assert _queued(Served(D_IDLE, 2.0, ttft=0.5, remote=False)) is False  # running is no queue


def test_a_p_d_sample_is_judged_by_its_prefiller_not_its_decoder() -> None:
    assert _queued(Served(D_BACKLOG, 2.0, ttft=0.5, remote=True, prefiller=P_IDLE)) is False
    assert _queued(Served(D_IDLE, 2.0, ttft=0.5, remote=True, prefiller=P_BUSY)) is True


def test_an_endpoint_the_plan_did_not_see_is_unknown() -> None:
    assert _queued(Served(D_UNREAD, 2.0, ttft=0.5, remote=False)) is None
    assert _queued(Served(D_IDLE, 2.0, ttft=0.5, remote=True)) is None  # prefiller unknown


def test_the_streams_its_decoder_ran_are_the_gateway_s_or_the_reading_s_the_larger() -> None:
    assert _observed(Served(D_BACKLOG, 2.0, itl=0.01, remote=False)).streams == 6
    assert _observed(Served(D_IDLE, 2.0, itl=0.01, remote=True, prefiller=P_IDLE)).streams == 4
    assert _observed(Served(D_UNREAD, 2.0, itl=0.01, remote=False)).streams is None


def _alone(served: Served) -> bool | None:
    return _observed(served).alone


def test_a_sample_is_alone_only_when_counts_and_a_fresh_reading_show_nothing_else() -> None:
    assert _alone(Served(D_QUIET, 2.0, ttft=0.5, remote=False)) is True
    assert _alone(Served(D_IDLE, 2.0, ttft=0.5, remote=False)) is False  # streams running
    assert _alone(Served(D_OWN, 2.0, ttft=0.5, remote=False)) is False  # the gateway's own
    assert _alone(Served(D_BACKLOG, 2.0, ttft=0.5, remote=False)) is None  # no reading
    assert _alone(Served(D_UNREAD, 2.0, ttft=0.5, remote=False)) is None


def test_a_request_the_reading_counted_as_the_gateways_own_is_not_someone_else_s() -> None:
    """A reading taken while a request of the gateways' ran shows it running after it
    left: that one is not another's (:attr:`LoadSnapshot.counted`); one more is."""
    assert _alone(Served(D_LEFT, 2.0, ttft=0.5, remote=False)) is True
    assert _alone(Served(D_OTHER, 2.0, ttft=0.5, remote=False)) is False


def test_a_p_d_sample_is_alone_by_its_prefiller() -> None:
    assert _alone(Served(D_IDLE, 2.0, ttft=0.5, remote=True, prefiller=P_QUIET)) is True
    assert _alone(Served(D_QUIET, 2.0, ttft=0.5, remote=True, prefiller=P_IDLE)) is None


def test_a_policy_that_observes_nothing_is_told_nothing() -> None:
    """No latency sample is built for a configuration whose policies learn none
    (``observes``): the default ``static`` policy's gateway skips it on every request."""
    served = Served(D_IDLE, 2.0, ttft=0.5, remote=False)
    silent = _Recorder(observes=False)
    _learn(silent, served)
    assert silent.seen == []
    told = _Recorder()
    _learn(told, served)
    assert [o.ttft for o in told.seen] == [0.5]
