"""``goodput``'s ``time_scale``: its knowledge on the gateway's clock when the fleet
is simulators run at a time scale (the live bench's ``--sim-time-scale``)."""

from __future__ import annotations

import pytest

from pd_orchestrator.bench.live import live_threshold
from pd_orchestrator.bench.results import Slo
from pd_orchestrator.bench.strategies import resolve_strategies
from pd_orchestrator.model.endpoints import Endpoint, Role
from pd_orchestrator.model.hardware import get_profile
from pd_orchestrator.model.measured import knowledge_for
from pd_orchestrator.policies.goodput import GoodputParams, GoodputPolicy

H200 = Endpoint(
    "d", "http://d:1", Role.DECODE, "h200", model="meta-llama/Llama-3.1-8B-Instruct",
    knowledge=knowledge_for("h200-llama3-8b"),
)  # fmt: skip
PROFILE = get_profile("h200-llama3-8b")


def test_a_profile_on_a_slower_clock_takes_that_much_longer_for_everything() -> None:
    slow = PROFILE.on_clock(20.0)
    assert PROFILE.on_clock(1.0) is PROFILE
    assert slow.prefill_seconds(4096, 1024) == pytest.approx(
        20 * PROFILE.prefill_seconds(4096, 1024)
    )
    assert slow.step_seconds(64 * 2048, 64, [(512, 0)]) == pytest.approx(
        20 * PROFILE.step_seconds(64 * 2048, 64, [(512, 0)])
    )
    assert slow.transfer_seconds(8192) == pytest.approx(20 * PROFILE.transfer_seconds(8192))


def test_time_scale_puts_the_seeds_and_the_profile_on_the_gateway_s_clock() -> None:
    plain, scaled = GoodputPolicy(GoodputParams()), GoodputPolicy(GoodputParams(time_scale=20.0))
    assert scaled.params.hop == pytest.approx(20 * plain.params.hop)
    assert plain.params.transfer_tokens_per_s is scaled.params.transfer_tokens_per_s is None
    assert scaled.params.prefill_tokens_per_s == pytest.approx(
        plain.params.prefill_tokens_per_s / 20
    )
    fast, slow = plain.model.pool(H200), scaled.model.pool(H200)
    assert slow.rate_local == pytest.approx(fast.rate_local / 20)
    assert slow.local_seconds(4096, 4096) == pytest.approx(20 * fast.local_seconds(4096, 4096))
    assert scaled.model.stream_step(slow, 2048, 16) == pytest.approx(
        20 * plain.model.stream_step(fast, 2048, 16)
    )
    assert scaled.model.handover(slow, 8192) == pytest.approx(20 * plain.model.handover(fast, 8192))
    bare = Endpoint("b", "http://b:1", Role.DECODE, "h200")  # seeds: the seeded hand-over too
    assert scaled.model.handover(scaled.model.pool(bare), 8192) == pytest.approx(
        20 * plain.model.handover(plain.model.pool(bare), 8192)
    )


def test_the_live_bench_gives_goodput_the_simulators_time_scale() -> None:
    """Regression: at ``--sim-time-scale 20`` the gateway's ``goodput`` believed every
    prefill 20 times faster than the simulators ran it (its profile is in simulated
    seconds) and kept every prompt local (512 of 512 at 4:4, 67 req/s)."""
    (goodput,) = resolve_strategies(["goodput"], slo=Slo(1.0, 0.03))
    block = live_threshold(goodput, 20.0)
    policy = GoodputPolicy(GoodputParams.model_validate(block["policy"]["params"]))
    seconds = policy.model.pool(H200).local_seconds(4096, 4096)
    assert seconds == pytest.approx(20 * PROFILE.prefill_seconds(4096, 0))
    assert "time_scale" not in live_threshold(goodput, 1.0)["policy"]["params"]
