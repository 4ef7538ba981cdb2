"""The flow machine: every decision of a request's flow, without I/O."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pd_orchestrator.config.settings import HandbackConfig, UpstreamConfig
from pd_orchestrator.flows.machine import (
    Alone,
    AtLimit,
    Done,
    FlowMachine,
    Serve,
    ThroughPD,
    skips_attempt,
)
from pd_orchestrator.flows.sink import GatewayError
from pd_orchestrator.model.route import Ask, Decline, GoPD, Local, Whole
from tests.flows.test_flow import D0, D1, _plan

HANDBACK = HandbackConfig(max_handbacks=2, leg_threshold=0.8, max_recoveries=1)


def _machine(
    *, fallback: str = "local", attempts: int = 3, continuable: bool = True
) -> FlowMachine:
    upstream = UpstreamConfig(prefill_fallback=fallback, decode_attempts=attempts)
    plan = replace(_plan(), continuable=continuable)
    return FlowMachine(plan, HANDBACK, upstream)


def test_an_admitted_attempt_serves_and_a_rejected_one_goes_pd_with_threshold_0() -> None:
    admitted = _machine()
    assert admitted.attempted(D0, admitted=True) == Serve()
    assert admitted.decision == "decode"
    rejected = _machine()
    assert rejected.attempted(D1, admitted=False) == ThroughPD(D1, 0.0)
    assert rejected.decision == "pd" and rejected.decoder == D1


def test_ask_all_s_local_fallback_serves_the_decoder_alone() -> None:
    machine = _machine()
    assert machine.attempted(D1, admitted=False, local=True) == Alone(D1)
    assert machine.decision == "decode"


@pytest.mark.parametrize(
    ("route", "skips"),
    [
        (GoPD("p", "r"), True),
        (Decline("p", "r"), True),
        (Ask(0.5, "p", "r"), False),
        (Local("p", "r"), False),
        (Whole("p", "r", "p0"), False),
    ],
)
def test_only_a_route_no_prompt_meets_skips_the_attempt(route: object, skips: bool) -> None:
    assert skips_attempt(route) is skips  # type: ignore[arg-type]


def test_no_prefiller_means_the_decoder_alone_or_a_503() -> None:
    machine = _machine()
    machine.attempted(D0, admitted=False)
    assert machine.without_prefiller(original_prompt=True) == Alone(D0)
    assert machine.decision == "decode"  # the original prompt was prefilled locally
    strict = _machine(fallback="error")
    strict.attempted(D0, admitted=False)
    with pytest.raises(GatewayError) as caught:
        strict.without_prefiller(original_prompt=True)
    assert caught.value.status == 503


def test_a_failed_prefill_side_falls_back_only_when_retryable_and_not_the_decoder_s() -> None:
    machine = _machine()
    machine.attempted(D0, admitted=False)
    assert machine.prefill_failed(retryable=False, endpoint="p0", original_prompt=True) is None
    assert machine.prefill_failed(retryable=True, endpoint="d0", original_prompt=True) is None
    assert machine.decision == "pd"
    assert machine.prefill_failed(retryable=True, endpoint="p0", original_prompt=True) == Alone(D0)
    assert machine.decision == "decode"
    continuing = _machine()
    continuing.attempted(D0, admitted=False)
    assert continuing.prefill_failed(retryable=True, endpoint="p0", original_prompt=False)
    assert continuing.decision == "pd"  # a continuation's fallback leaves the decision


def test_hand_backs_go_pd_at_the_leg_threshold_then_alone_after_the_limit() -> None:
    machine = _machine()
    machine.attempted(D0, admitted=True)
    assert machine.leg_ended(handed_back=False, remaining=3, next_decoder=None) == Done()
    steps = [machine.leg_ended(handed_back=True, remaining=5, next_decoder=None) for _ in range(3)]
    assert steps == [ThroughPD(D0, 0.8), ThroughPD(D0, 0.8), Alone(D0)]
    assert machine.handbacks == 3
    moved = _machine()
    moved.attempted(D0, admitted=True)
    assert moved.leg_ended(handed_back=True, remaining=5, next_decoder=D1) == ThroughPD(D1, 0.8)
    assert moved.decoder == D1


def test_a_hand_back_at_the_token_limit_ends_the_answer() -> None:
    machine = _machine()
    machine.attempted(D0, admitted=True)
    assert machine.leg_ended(handed_back=True, remaining=0, next_decoder=D1) == AtLimit()
    assert machine.decoder == D0 and machine.handbacks == 1


def test_a_plan_that_cannot_be_continued_answers_a_hand_back_502() -> None:
    machine = _machine(continuable=False)
    machine.attempted(D0, admitted=True)
    with pytest.raises(GatewayError) as caught:
        machine.leg_ended(handed_back=True, remaining=5, next_decoder=None)
    assert caught.value.status == 502
    assert not machine.may_recover(retryable=True, has_prompt_ids=True)


def test_starting_over_needs_a_retryable_decoder_failure_within_the_attempts() -> None:
    machine = _machine(attempts=2)
    assert not machine.may_start_over(retryable=False, on_decoder=True)
    assert not machine.may_start_over(retryable=True, on_decoder=False)
    assert machine.may_start_over(retryable=True, on_decoder=True)
    retried = replace(machine.plan, decoders=(D1,))
    machine.attempted(D0, admitted=False)
    assert machine.start_over(retried) and machine.plan is retried
    assert machine.decision == "decode"  # the new start decides afresh
    assert not machine.may_start_over(retryable=True, on_decoder=True)  # 2 decoders tried
    assert not _machine().start_over(None)  # no decoder left


def test_recoveries_continue_on_the_next_decoder_within_their_limit() -> None:
    machine = _machine()
    machine.attempted(D0, admitted=True)
    assert not machine.may_recover(retryable=False, has_prompt_ids=True)
    assert not machine.may_recover(retryable=True, has_prompt_ids=False)
    assert machine.may_recover(retryable=True, has_prompt_ids=True)
    assert machine.recover(None, 5) is None  # no decoder left
    assert machine.recover(D1, 5) == ThroughPD(D1, 0.8)
    assert machine.recoveries == 1 and machine.handbacks == 0
    assert not machine.may_recover(retryable=True, has_prompt_ids=True)  # max_recoveries 1
