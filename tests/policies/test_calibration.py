"""Start-up calibration: which endpoints the gateway times, and what ``goodput`` learns
of the prompts it timed (and does not)."""

from __future__ import annotations

import pytest

from pd_orchestrator.model.endpoints import Endpoint, Role
from pd_orchestrator.model.load import Candidate, LoadSnapshot
from pd_orchestrator.model.measured import knowledge_for
from pd_orchestrator.policies import LatencyObservation
from pd_orchestrator.policies.calibration import Probe, Timed, plan_probes
from pd_orchestrator.policies.goodput import GoodputPolicy
from pd_orchestrator.policies.goodput_model import GoodputParams

H200 = knowledge_for("h200-llama3-8b")
SEED = GoodputParams().prefill_tokens_per_s
HOP = GoodputParams().hop


def _endpoint(name: str, pool: str, role: Role, **more: object) -> Endpoint:
    return Endpoint(name, f"http://{name}:1", role, pool=pool, **more)  # type: ignore[arg-type]


def _busy(endpoint: Endpoint, running: int) -> Candidate:
    return Candidate(endpoint, load=LoadSnapshot(running, 0, 0.1, 0.0))


D0, D1 = _endpoint("d0", "decode", Role.DECODE), _endpoint("d1", "decode", Role.DECODE)
P0 = _endpoint("p0", "prefill", Role.PREFILL)
KNOWN = _endpoint("k0", "known", Role.DECODE, knowledge=H200)
OTHER = _endpoint("o0", "other", Role.DECODE, group="elsewhere")


def test_one_probe_per_pool_that_knows_nothing_on_its_least_busy_healthy_endpoint() -> None:
    policy = GoodputPolicy(GoodputParams(probe_tokens=(1024, 4096), probe_repeats=1))
    candidates = [
        _busy(D0, running=3), _busy(D1, running=0), Candidate(P0), Candidate(KNOWN),
        Candidate(OTHER, healthy=False),
    ]  # fmt: skip
    probes = policy.probes(candidates)
    assert probes == [
        Probe(D1, (1024, 4096), (), 30.0),
        # the prefiller's prompts also time the remote path of the decoder pools of its
        # group that have no profile: not `known`, not `other` (another group)
        Probe(P0, (1024, 4096), (D0,), 30.0),
    ]


def test_no_probe_without_lengths_or_once_the_pool_has_learnt_a_local_rate() -> None:
    assert GoodputPolicy(GoodputParams(probe_tokens=())).probes([Candidate(D0)]) == []
    policy = GoodputPolicy()
    policy.model.pool(D0)
    lengths = (2048, 2048, 4096, 4096, 8192, 8192, 16384, 16384, 32768, 32768)
    assert policy.probes([Candidate(D0)]) == [Probe(D0, lengths)]  # the defaults
    policy.model.calibrate(Probe(D0, (4096,)), Timed(4096, 0, 4096 / 30_000 + 2 * HOP, alone=True))
    assert policy.probes([Candidate(D0)]) == []  # it has learnt a local rate
    assert plan_probes([Candidate(D0)], lambda e: True, (), 30.0) == []


def test_a_timed_cold_prompt_moves_the_local_and_remote_rates_from_the_seed() -> None:
    """The prompt took what 30,000 tokens/s takes: the decoder pool's local rate (a
    decoder's probe) and its remote rate (its group's prefiller's) move to it, the
    prefill pool's local rate too; nothing else is learnt from a prompt no client sent."""
    policy = GoodputPolicy()
    model = policy.model
    seconds = 4096 / 30_000 + 2 * HOP
    model.calibrate(Probe(D0, (4096,)), Timed(4096, 0, seconds, queued=False, alone=True))
    model.calibrate(Probe(P0, (4096,), (D0,)), Timed(4096, 0, seconds, queued=False, alone=True))
    decode, prefill = model.pools["decode"], model.pools["prefill"]
    assert decode.rate_local == pytest.approx(30_000, rel=1e-6)
    assert decode.rate_remote == pytest.approx(30_000, rel=1e-6)
    assert prefill.rate_local == pytest.approx(30_000, rel=1e-6)
    assert decode.measured and prefill.measured
    assert (model.prompt_mean, model.out_mean, decode.itl) == (0.0, 0.0, None)


def test_a_timed_prompt_moves_a_rate_by_at_most_the_bounded_step() -> None:
    """A probe timed at 1 ms (a cached answer, a clock gone wrong) lifts the seed by x1.5
    at most, as any sample does."""
    model = GoodputPolicy().model
    model.calibrate(Probe(D0, (4096,)), Timed(4096, 0, 0.001 + 2 * HOP, alone=True))
    assert model.pools["decode"].rate_local == pytest.approx(1.5 * SEED)


def test_a_probe_with_no_cached_count_or_queued_behind_others_teaches_no_local_rate() -> None:
    model = GoodputPolicy().model
    fast = 4096 / 30_000 + 2 * HOP
    model.calibrate(Probe(D0, (4096,)), Timed(4096, None, fast, alone=True))  # not reported
    model.calibrate(Probe(D0, (4096,)), Timed(4096, 0, fast, queued=True, alone=False))
    assert model.pools["decode"].rate_local == SEED
    assert not model.pools["decode"].measured


def test_a_pool_with_a_profile_learns_nothing_from_a_probe() -> None:
    model = GoodputPolicy().model
    before = model.pool(KNOWN).rate_local
    model.calibrate(Probe(P0, (4096,), (KNOWN,)), Timed(4096, 0, 0.2, alone=True))
    model.calibrate(Probe(KNOWN, (4096,)), Timed(4096, 0, 0.2, alone=True))
    assert model.pools["known"].rate_local == before
    assert model.pools["known"].rate_remote == before
    assert not model.unknown(KNOWN)


def test_a_served_request_still_teaches_after_a_probe() -> None:
    """The probe's samples join the ones a rate keeps timed alone; later traffic moves
    it as before."""
    model = GoodputPolicy().model
    model.calibrate(Probe(D0, (4096,)), Timed(4096, 0, 4096 / 30_000 + 2 * HOP, alone=True))
    for _ in range(8):
        model.observe(
            LatencyObservation(
                "m", "decode", 1.0, 4096 / 36_000 + 2 * HOP, prompt_tokens=4096,
                cached_tokens=0, remote=False, queued=False, alone=True,
            )
        )  # fmt: skip
    assert model.pools["decode"].rate_local == pytest.approx(36_000, rel=1e-6)
