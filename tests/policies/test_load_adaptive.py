"""``load-adaptive``: the target formula, smoothing, dead band and stability."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from pd_orchestrator.model.load import Candidate, LoadSnapshot
from pd_orchestrator.model.route import threshold_of
from pd_orchestrator.policies import LoadAdaptiveParams, LoadAdaptivePolicy, ThresholdPolicy
from tests.policies.helpers import IDLE_PREFILL, build, context, decoder, load, prefiller


def _policy(**params: Any) -> ThresholdPolicy:
    return build({"type": "load-adaptive", "params": params})


BUSY = decoder(reading=load(running=64))
QUEUEING = (prefiller(reading=load(running=4, waiting=8)),)


@pytest.mark.parametrize(
    ("dec", "prefillers", "value", "reason"),
    [
        (decoder(reading=load()), IDLE_PREFILL, 0.7, "balanced"),
        (BUSY, IDLE_PREFILL, 0.95, "decoder-busy"),
        (decoder(reading=load(running=32)), IDLE_PREFILL, 0.825, "decoder-busy"),
        (decoder(reading=load(waiting=2)), IDLE_PREFILL, 0.825, "decoder-busy"),
        (decoder(reading=load(kv=0.7)), IDLE_PREFILL, 0.825, "decoder-busy"),
        (decoder(reading=load(kv=0.5)), IDLE_PREFILL, 0.7, "balanced"),
        (decoder(in_flight=16), IDLE_PREFILL, 0.7625, "decoder-busy"),
        (decoder(in_flight=64, reading=load(running=3)), IDLE_PREFILL, 0.95, "decoder-busy"),
        (decoder(reading=load()), QUEUEING, 0.0, "prefill-queueing"),
        (
            BUSY,
            (prefiller(reading=load(waiting=4)),),
            0.7 + 0.25 * 0.5 - 0.7 * 0.5,
            "prefill-queueing",
        ),
        (BUSY, (*QUEUEING, prefiller("p1", reading=load(waiting=0))), 0.95, "decoder-busy"),
        (BUSY, (), 0.0, "no-prefiller"),
        (BUSY, (prefiller(healthy=False, reading=load()),), 0.0, "no-prefiller"),
        (decoder(reading=load()), (prefiller(in_flight=8),), 0.0, "prefill-queueing"),
        (decoder(reading=load()), (prefiller(in_flight=2),), 0.525, "prefill-queueing"),
    ],
    ids=[
        "idle",
        "decoder-full",
        "decoder-half-running",
        "decoder-waiting",
        "decoder-kv",
        "kv-at-low-mark",
        "in-flight-without-reading",
        "in-flight-beyond-reading",
        "prefill-queueing",
        "both-busy-prefill-half-queueing",
        "shallowest-prefiller-counts",
        "no-prefiller",
        "unhealthy-prefillers",
        "prefiller-in-flight-without-reading",
        "prefiller-partly-busy",
    ],
)
def test_target_table(
    dec: Candidate, prefillers: Sequence[Candidate], value: float, reason: str
) -> None:
    decision = _policy().decide(context(dec=dec, prefillers=prefillers))
    assert threshold_of(decision) == pytest.approx(value)
    assert (decision.policy, decision.reason) == ("load-adaptive", reason)


def test_bounds_are_configurable() -> None:
    policy = _policy(floor=0.5, base=0.6, ceiling=0.8)
    assert policy.bounds == (0.5, 0.8)
    assert threshold_of(policy.decide(context(dec=BUSY))) == 0.8
    assert threshold_of(policy.decide(context(dec=decoder("d1"), prefillers=QUEUEING))) == 0.5


@pytest.mark.parametrize(
    ("params", "fragment"),
    [
        ({"floor": 0.8, "base": 0.7}, "floor <= base <= ceiling"),
        ({"kv_usage_low": 0.9, "kv_usage_high": 0.5}, "kv_usage_low"),
        ({"dead_band": 0.9}, "dead_band"),
        ({"decoder_requests_full": 0}, "decoder_requests_full"),
    ],
    ids=["base-below-floor", "kv-ramp-reversed", "dead-band-too-wide", "zero-ramp"],
)
def test_inconsistent_params_are_refused(params: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ValidationError, match=fragment):
        LoadAdaptiveParams.model_validate(params)


def test_a_load_change_is_smoothed_in_time() -> None:
    policy = _policy(smoothing_seconds=5.0, dead_band=0.0)
    idle = decoder(reading=load())
    assert threshold_of(policy.decide(context(dec=idle, now=0.0))) == pytest.approx(0.7)
    first = threshold_of(policy.decide(context(dec=BUSY, now=1.0)))
    assert first == pytest.approx(0.7 + 0.25 * (1 - math.exp(-1 / 5)))
    same_instant = threshold_of(policy.decide(context(dec=BUSY, now=1.0)))
    assert same_instant == first  # no time passed: no move
    later = threshold_of(policy.decide(context(dec=BUSY, now=60.0)))
    assert later == pytest.approx(0.95, abs=1e-4)


def test_a_queueing_prefill_pool_settles_the_threshold_at_exactly_the_floor() -> None:
    """Only a threshold of exactly 0 admits a prompt with no cached token: smoothing
    must settle there, not approach it forever."""
    policy = _policy()  # the defaults: floor 0, lower_by 0.7
    values = [
        threshold_of(policy.decide(context(prefillers=QUEUEING, now=0.5 * step)))
        for step in range(200)
    ]
    assert values[0] == 0.0  # the first request takes the target as is
    policy = _policy()
    policy.decide(context(now=0.0))  # idle: 0.7
    values = [
        threshold_of(policy.decide(context(prefillers=QUEUEING, now=0.5 * step)))
        for step in range(1, 200)
    ]
    assert values[-1] == 0.0
    assert all(a >= b for a, b in itertools.pairwise(values))  # monotone descent


def test_without_smoothing_the_value_follows_the_target() -> None:
    policy = _policy(smoothing_seconds=0.0, dead_band=0.0)
    policy.decide(context(now=0.0))
    assert threshold_of(policy.decide(context(dec=BUSY, now=0.5))) == pytest.approx(0.95)


def test_moves_smaller_than_the_dead_band_are_not_sent() -> None:
    policy = _policy(smoothing_seconds=0.0, dead_band=0.05)
    assert threshold_of(policy.decide(context(now=0.0))) == pytest.approx(0.7)
    slightly = decoder(reading=load(running=8))  # target 0.73125
    assert threshold_of(policy.decide(context(dec=slightly, now=1.0))) == pytest.approx(0.7)
    more = decoder(reading=load(running=16))  # target 0.7625
    assert threshold_of(policy.decide(context(dec=more, now=2.0))) == pytest.approx(0.7625)


def test_each_decoder_is_smoothed_on_its_own() -> None:
    policy = _policy(smoothing_seconds=2.0)
    busy = decoder("busy", reading=load(running=64))
    idle = decoder("idle", reading=load())
    for step in range(200):
        a = policy.decide(context(dec=busy, now=step * 0.5))
        b = policy.decide(context(dec=idle, now=step * 0.5))
    assert threshold_of(a) == pytest.approx(0.95, abs=0.02)
    assert threshold_of(b) == pytest.approx(0.7)


def test_a_replay_decides_alike() -> None:
    sequence = [
        context(dec=decoder(reading=load(running=r, waiting=w)), now=t * 0.7)
        for t, (r, w) in enumerate([(0, 0), (40, 1), (64, 5), (10, 0), (3, 0)] * 5)
    ]
    first, second = _policy(), _policy()
    assert [first.decide(c) for c in sequence] == [second.decide(c) for c in sequence]


readings = st.builds(
    LoadSnapshot,
    running=st.integers(0, 300),
    waiting=st.integers(0, 50),
    kv_usage=st.floats(0.0, 1.0),
    observed_at=st.just(0.0),
)
decoders = st.builds(
    lambda name, in_flight, reading: decoder(name, in_flight=in_flight, reading=reading),
    st.sampled_from(["d0", "d1", "d2"]),
    st.integers(0, 200),
    st.none() | readings,
)
prefill_pools = st.lists(
    st.builds(
        lambda i, healthy, in_flight, reading: prefiller(
            f"p{i}", healthy=healthy, in_flight=in_flight, reading=reading
        ),
        st.integers(0, 3),
        st.booleans(),
        st.integers(0, 20),
        st.none() | readings,
    ),
    max_size=3,
)
params = st.fixed_dictionaries(
    {
        "floor": st.floats(0.0, 0.5),
        "ceiling": st.floats(0.5, 1.0),
        "smoothing_seconds": st.floats(0.0, 10.0),
        "dead_band": st.floats(0.0, 0.1),
    }
)


@settings(max_examples=60)
@given(
    params=params,
    steps=st.lists(
        st.tuples(decoders, prefill_pools, st.floats(0.0, 5.0)), min_size=1, max_size=40
    ),
)
def test_values_stay_within_bounds(
    params: dict[str, float],
    steps: list[tuple[Candidate, list[Candidate], float]],
) -> None:
    policy = _policy(**params, base=0.5)
    low, high = policy.bounds
    now = 0.0
    for dec, prefillers, dt in steps:
        now += dt
        value = threshold_of(policy.decide(context(dec=dec, prefillers=prefillers, now=now)))
        assert low <= value <= high


@settings(max_examples=60)
@given(
    dec=decoders,
    prefillers=prefill_pools,
    smoothing=st.floats(0.0, 5.0),
    dead_band=st.floats(0.0, 0.1),
    gaps=st.lists(st.floats(0.5, 2.0), min_size=400, max_size=400),
)
def test_a_constant_load_converges_and_stays_put(
    dec: Candidate,
    prefillers: list[Candidate],
    smoothing: float,
    dead_band: float,
    gaps: list[float],
) -> None:
    policy = _policy(smoothing_seconds=smoothing, dead_band=dead_band)
    assert isinstance(policy, LoadAdaptivePolicy)
    now, values = 0.0, []
    for gap in gaps:
        now += gap
        values.append(threshold_of(policy.decide(context(dec=dec, prefillers=prefillers, now=now))))
    target = policy.target(context(dec=dec, prefillers=prefillers))
    tail = values[200:]  # at least 100 s, 20 time constants, after the start
    assert max(tail) - min(tail) < 1e-6
    assert abs(tail[-1] - target) <= dead_band + 1e-6


def test_noise_within_the_dead_band_leaves_the_value_steady() -> None:
    policy = _policy(smoothing_seconds=5.0, dead_band=0.02)
    noisy = [decoder(reading=load(running=r)) for r in (30, 34, 31, 33)]
    values = [
        threshold_of(policy.decide(context(dec=noisy[i % 4], now=i * 0.5))) for i in range(400)
    ]
    assert len(set(values[100:])) == 1
