"""The prefill attempts' retry policy (tenacity): what is retried, how often, how long
it waits, and that the budget's deadline ends it."""

from __future__ import annotations

import gc
from typing import Any

import anyio
import pytest
from tenacity import AsyncRetrying

from connectors import get_connector
from pd_orchestrator.config.settings import UpstreamConfig
from pd_orchestrator.flows.handover import Handover, HandoverResult
from pd_orchestrator.model.endpoints import Endpoint, Role
from pd_orchestrator.upstream.errors import (
    UpstreamError,
    UpstreamStatusError,
    UpstreamTimeout,
    UpstreamUnavailable,
)

pytestmark = pytest.mark.anyio

DECODER = Endpoint("d0", "http://d0", Role.DECODE)
PREFILLER = Endpoint("p0", "http://p0", Role.PREFILL)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _handover(clock: Clock, **upstream: Any) -> Handover:
    config = UpstreamConfig(**({"prefill_attempts": 3, "retry_backoff": 0.01} | upstream))
    legs: Any = None  # the policy never touches the legs
    return Handover(legs, get_connector("nixl"), DECODER, (PREFILLER,), config, clock)


async def _run(handover: Handover, failures: list[UpstreamError], deadline: float) -> int:
    """Attempts made against ``failures`` (one raised per attempt, then success)."""
    calls = 0

    async def attempt() -> HandoverResult:
        nonlocal calls
        calls += 1
        handover.prefiller = PREFILLER
        if calls <= len(failures):
            raise failures[calls - 1]
        return HandoverResult(leg=None, prefiller=PREFILLER)  # type: ignore[arg-type]

    with anyio.fail_after(10):
        await handover._retrying(deadline)(attempt)
    return calls


def _unavailable(endpoint: str = "p0") -> UpstreamError:
    return UpstreamUnavailable(endpoint, "prefill", "refused")


async def test_retryable_failures_of_the_prefiller_are_retried_until_one_succeeds() -> None:
    failures = [_unavailable(), UpstreamTimeout("p0", "prefill", "slow")]
    assert await _run(_handover(Clock()), failures, deadline=60.0) == 3


async def test_at_most_prefill_attempts_then_the_last_failure_as_it_is() -> None:
    last = UpstreamStatusError("p0", "prefill", 503, "busy")
    with pytest.raises(UpstreamStatusError) as caught:
        await _run(_handover(Clock()), [_unavailable(), _unavailable(), last, _unavailable()], 60.0)
    assert caught.value is last


@pytest.mark.parametrize(
    "failure",
    [
        UpstreamStatusError("p0", "prefill", 400, "bad prompt"),  # the request's own fault
        _unavailable("d0"),  # the decode leg's, not the prefiller's
    ],
    ids=["client-4xx", "decoder-failed"],
)
async def test_failures_that_another_attempt_cannot_fix_are_raised_at_once(
    failure: UpstreamError,
) -> None:
    calls = 0

    async def attempt() -> HandoverResult:
        nonlocal calls
        calls += 1
        raise failure

    handover = _handover(Clock())
    handover.prefiller = PREFILLER
    with pytest.raises(UpstreamError) as caught:
        await handover._retrying(60.0)(attempt)
    assert caught.value is failure and calls == 1


async def test_no_attempt_whose_backoff_would_end_past_the_deadline() -> None:
    clock = Clock()
    clock.now = 59.999  # any backoff but 0 ends past 60
    with pytest.raises(UpstreamUnavailable):
        await _run(_handover(clock, retry_backoff=1.0), [_unavailable()] * 3, deadline=60.0)


async def test_the_backoff_is_full_jitter_exponential_capped_at_two_seconds() -> None:
    handover = _handover(Clock(), retry_backoff=1.5, prefill_attempts=10)
    wait = handover._retrying(1e9).wait
    state: Any = type("State", (), {})()
    for attempt, bound in [(1, 1.5), (2, 2.0), (5, 2.0)]:
        state.attempt_number = attempt
        waits = [wait(state) for _ in range(200)]
        assert all(0.0 <= w <= bound for w in waits)
        assert max(waits) > bound * 0.8  # the window is used, not a fixed pause


class _Legs:
    def allowance(self) -> float:
        return 0.0


class _Scripted(Handover):
    """A hand-over whose attempts fail ``failures`` times (the prefiller's retryable
    failure), then succeed."""

    failures = 0

    async def _attempt(self, shape: Any, deadline: float, tried: list[str]) -> HandoverResult:
        self.prefiller = PREFILLER
        tried.append(PREFILLER.name)
        if len(tried) <= self.failures:
            raise _unavailable()
        return HandoverResult(leg=None, prefiller=PREFILLER)  # type: ignore[arg-type]


@pytest.mark.parametrize("failures", [0, 1, 3], ids=["first", "retried", "all-failed"])
async def test_a_finished_handover_leaves_no_reference_cycle(failures: int) -> None:
    """The retrying object, the hand-over and its legs are freed by reference counting
    when the hand-over ends, succeeded or failed: tenacity's kept actions and the last
    failure's traceback (through tenacity's frame) would otherwise hold them until a
    full collection, which the gateway's collector thresholds make rare."""
    config = UpstreamConfig(prefill_attempts=3, retry_backoff=0.001)
    gc.collect()
    before = {id(o) for o in gc.get_objects()}
    gc.disable()  # what is left must be freed by reference counting alone
    try:
        for _ in range(20):
            handover = _Scripted(
                _Legs(), get_connector("nixl"), DECODER, (PREFILLER,), config, Clock()
            )  # type: ignore[arg-type]
            handover.failures = failures
            try:
                result = await handover.run(
                    {}, "/v1/completions", "completion", original_prompt=True
                )  # type: ignore[arg-type]
            except UpstreamUnavailable:
                assert failures == 3
            else:
                assert result.prefiller is PREFILLER and failures < 3
        del handover
        left = [
            o
            for o in gc.get_objects()
            if isinstance(o, AsyncRetrying | Handover) and id(o) not in before
        ]
    finally:
        gc.enable()
    assert left == []
