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
        # the decoder's probe ends with its decode step prompt (32 output tokens)
        Probe(D1, (1024, 4096), (), 30.0, step_tokens=32),
        # the prefiller's prompts also time the remote path of the decoder pools of its
        # group that have no profile: not `known`, not `other` (another group); it times
        # no decode step (it decodes nothing)
        Probe(P0, (1024, 4096), (D0,), 30.0),
    ]


def test_no_probe_without_lengths_or_once_the_pool_has_learnt_a_local_rate() -> None:
    assert GoodputPolicy(GoodputParams(probe_tokens=())).probes([Candidate(D0)]) == []
    policy = GoodputPolicy()
    policy.model.pool(D0)
    lengths = (2048, 2048, 4096, 4096, 8192, 8192, 16384, 16384, 32768, 32768)
    assert policy.probes([Candidate(D0)]) == [Probe(D0, lengths, step_tokens=32)]  # defaults
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


def _engine_seconds(new: int, fixed: float, rate: float, attn: float) -> float:
    """A cold prefill of ``new`` tokens on an engine with a fixed cost, a rate and an
    attention term, the way the gateway times it (two hops added)."""
    return fixed + new / rate + attn * new * new / 2 + 2 * HOP


@pytest.mark.parametrize("fixed", [0.0, 0.008, 0.03])
def test_the_default_probes_learn_the_rate_net_of_a_fixed_prefill_cost(fixed: float) -> None:
    """The default lengths (2k-32k, twice each) on an engine that pays ``fixed`` seconds
    a prefill: the pool learns that cost apart, so the rate and the attention term are
    the engine's (a fixed 8 ms read as rate put it 4% low)."""
    policy = GoodputPolicy()
    rate, attn = 34_000.0, 0.96e-9
    for tokens in policy.model.params.probe_tokens:
        for _ in range(2):
            seconds = _engine_seconds(tokens, fixed, rate, attn)
            policy.model.calibrate(Probe(D0, (tokens,)), Timed(tokens, 0, seconds, alone=True))
    learnt = policy.model.pools["decode"]
    assert learnt.fixed == pytest.approx(fixed, abs=1e-6)
    assert learnt.rate_local == pytest.approx(rate, rel=1e-3)
    assert learnt.attn == pytest.approx(attn, rel=1e-3)
    assert policy.model.learnt()["decode"]["prefill_fixed"] == learnt.fixed


def test_a_fixed_cost_is_not_learnt_from_too_few_lengths_or_a_slowed_short_prompt() -> None:
    """Two octaves cannot part a fixed cost from a rate: it stays 0, as it does where
    the shortest prompts were slowed by something else (a fit that would put more than
    half their time in the fixed part)."""
    two = GoodputPolicy().model
    for tokens in (4096, 4096, 4096, 4096, 8192, 8192, 8192, 8192):
        seconds = _engine_seconds(tokens, 0.008, 34_000.0, 0.96e-9)
        two.calibrate(Probe(D0, (tokens,)), Timed(tokens, 0, seconds, alone=True))
    assert two.pools["decode"].fixed == 0.0
    slowed = GoodputPolicy().model
    for tokens in (1024, 1024, 1024, 1024, 4096, 4096, 16384, 16384):
        seconds = _engine_seconds(tokens, 0.0, 34_000.0, 0.0) + (0.2 if tokens == 1024 else 0.0)
        slowed.calibrate(Probe(D0, (tokens,)), Timed(tokens, 0, seconds, alone=True))
    assert slowed.pools["decode"].fixed == 0.0


def test_the_decode_step_prompt_teaches_the_step_of_one_stream_and_no_rate() -> None:
    """A prompt that generated 32 tokens took its prefill (as learnt), then 31 steps: the
    pool's step at one stream is the rest over 31, and every batch is priced at it until
    traffic teaches the line; the rates stay. A pool with a profile learns nothing."""
    policy = GoodputPolicy()
    model = policy.model
    fixed, rate, attn, step = 0.008, 34_000.0, 0.96e-9, 0.0065
    for tokens in model.params.probe_tokens:
        for _ in range(2):
            seconds = _engine_seconds(tokens, fixed, rate, attn)
            model.calibrate(Probe(D0, (tokens,)), Timed(tokens, 0, seconds, alone=True))
    before = model.pools["decode"].rate_local
    seconds = _engine_seconds(2048, fixed, rate, attn) + 31 * step
    model.calibrate(Probe(D0, (2048,)), Timed(2048, 0, seconds, alone=True, output=32))
    decode = model.pools["decode"]
    assert decode.steps.at(1) == pytest.approx(step, rel=1e-3)
    assert model.stream_step(decode, 2048, 16) == pytest.approx(step, rel=1e-3)
    assert decode.rate_local == before and decode.itl is None
    model.calibrate(Probe(KNOWN, (2048,)), Timed(2048, 0, 0.5, alone=True, output=32))
    assert not model.pool(KNOWN).steps.octaves


def test_a_streamed_step_prompt_teaches_its_gap_whatever_its_prefill_is_priced_at() -> None:
    """Streamed, a step prompt's step is its mean gap between tokens, read apart from
    its prefill: no rate need be learnt, and a prefill the rates price dear (which,
    taken off its time, left 0.7 ms of a 6 ms step on the CPU pair) changes nothing."""
    model = GoodputPolicy().model
    model.calibrate(Probe(D0, (2048,)), Timed(2048, 0, 0.3, alone=True, output=32, gap=0.006))
    assert model.pool(D0).steps.at(1) == pytest.approx(0.006)  # before any rate
    model.calibrate(Probe(D0, (4096,)), Timed(4096, 0, 4096 / 30_000 + 2 * HOP, alone=True))
    seconds = 2048 / 40_000 + 31 * 0.005  # the learnt 30,000 tokens/s prices it dear
    model.calibrate(Probe(D0, (2048,)), Timed(2048, 0, seconds, alone=True, output=32, gap=0.005))
    assert model.pool(D0).steps.at(1) == pytest.approx(0.0055)  # the median of 6 and 5 ms


def test_a_decode_step_prompt_teaches_no_step_before_a_rate_or_when_it_cannot() -> None:
    """Before the pool has learnt a local rate (its prefill priced on the seeds), timed
    shorter than the learnt prefill (a rate gone wrong, a clock), or with no cached
    count: no step is learnt."""
    model = GoodputPolicy().model
    model.calibrate(Probe(D0, (2048,)), Timed(2048, 0, 0.5, alone=True, output=32))
    assert not model.pool(D0).steps.octaves  # no rate learnt yet
    model.calibrate(Probe(D0, (4096,)), Timed(4096, 0, 4096 / 30_000 + 2 * HOP, alone=True))
    model.calibrate(Probe(D0, (2048,)), Timed(2048, 0, 0.001, alone=True, output=32))
    model.calibrate(Probe(D0, (2048,)), Timed(2048, None, 5.0, alone=True, output=32))
    assert not model.pool(D0).steps.octaves
    model.calibrate(Probe(D0, (2048,)), Timed(2048, 0, 0.5, alone=True, output=32))
    assert model.pool(D0).steps.octaves  # the same prompt, once a rate is learnt


def test_the_end_of_a_probe_forgets_the_hit_rate_remembered_at_its_endpoint() -> None:
    """A reading whose window held the probe's cold prompts read them as misses: once
    the probe ends, the policy no longer holds that endpoint's hit rate (others stay)."""
    policy = GoodputPolicy()
    probed = Candidate(D0, load=LoadSnapshot(1, 0, 0.1, 0.0, prefix_hit_rate=0.0))
    other = Candidate(D1, load=LoadSnapshot(1, 0, 0.1, 0.0, prefix_hit_rate=0.8))
    policy.model.saw([probed, other])
    assert policy.model.hit_rate(Candidate(D0)) == 0.0
    policy.model.calibrated(D0.name)
    assert policy.model.hit_rate(Candidate(D0)) is None
    assert policy.model.hit_rate(Candidate(D1)) == 0.8


def test_a_probe_sends_its_lengths_then_its_step_prompt_each_where_the_model_fits_it() -> None:
    """Each length for one token, then the shortest for ``step_tokens``, as often as it
    came and three times at least; a length the model's context cannot take with its
    output is left out (2048 + 31 > 2048)."""
    probe = Probe(D0, (1024, 2048, 4096), step_tokens=32)
    assert probe.prompts() == [(1024, 1), (2048, 1), (4096, 1), *[(1024, 32)] * 3]
    assert probe.prompts(2048) == [(1024, 1), (2048, 1), *[(1024, 32)] * 3]
    assert Probe(D0, (2048,), step_tokens=32).prompts(2048) == [(2048, 1)]
    assert Probe(P0, (1024,)).prompts() == [(1024, 1)]  # no step: a dedicated prefiller
    repeated = Probe(D0, (1024,) * 4 + (4096,) * 4, step_tokens=32)  # probe_repeats 4
    assert repeated.prompts()[8:] == [(1024, 32)] * 4


def test_the_median_of_the_decode_step_prompts_is_the_step_a_slowed_one_moves_nothing() -> None:
    """The probe's step prompts are read as a timing's repeats, their median the pool's
    step at one stream: one slowed 2.5x (as one on the CPU pair read 12.4 ms beside an
    ITL of 5.0 ms), first, between or last, leaves it at the step once three have come."""
    fixed, rate, attn, step = 0.008, 34_000.0, 0.96e-9, 0.005
    for slowed in range(3):
        model = GoodputPolicy().model
        for tokens in model.params.probe_tokens:
            seconds = _engine_seconds(tokens, fixed, rate, attn)
            model.calibrate(Probe(D0, (tokens,)), Timed(tokens, 0, seconds, alone=True))
        for k in range(3):
            each = 2.5 * step if k == slowed else step
            seconds = _engine_seconds(2048, fixed, rate, attn) + 31 * each
            model.calibrate(Probe(D0, (2048,)), Timed(2048, 0, seconds, alone=True, output=32))
        assert model.pools["decode"].steps.at(1) == pytest.approx(step, rel=0.05), slowed
