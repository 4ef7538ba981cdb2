"""The latency profiles' step model against the calibration points and the shape of
published chunked-prefill measurements (Sarathi-Serve, DistServe)."""

from __future__ import annotations

import pytest

from pd_orchestrator.model.hardware import LatencyProfile, get_profile

H200 = get_profile("h200-llama3-8b")
CTX = 2048


@pytest.mark.parametrize(
    ("profile", "itl_ms"),
    [
        ("h200-llama3-8b", {1: 6.5, 64: 11.2, 256: 25.5}),
        ("mi325x-llama3-8b", {1: 7.2, 64: 11.5, 256: 24.7}),
    ],
)
def test_decode_steps_meet_the_itl_table(profile: str, itl_ms: dict[int, float]) -> None:
    step = get_profile(profile)
    for batch, expected in itl_ms.items():
        assert step.step_seconds(batch * CTX, batch, 0.0) * 1e3 == pytest.approx(expected, abs=0.05)


def test_prefill_only_steps_meet_the_prefill_table() -> None:
    for tokens, expected_ms in ((2048, 70), (8192, 282)):
        seconds = H200.step_seconds(0, 0, H200.prefill_seconds(tokens, 0))
        assert seconds * 1e3 == pytest.approx(expected_ms, rel=0.01)


def free_chunk_tokens(profile: LatencyProfile, decode_context: int, num_decode: int) -> int:
    """The largest prefill chunk (new tokens, no cached context) that leaves a step of
    ``num_decode`` decodes memory-bound: it adds no time to their step."""
    spare = profile.weights + profile.ctx_read * decode_context - num_decode * profile.lin
    tokens, step = 0, 1 << 16
    while step:  # the largest n with prefill_seconds(n, 0) <= spare (monotone)
        if profile.prefill_seconds(tokens + step, 0) <= spare:
            tokens += step
        step >>= 1
    return tokens


def test_a_small_chunk_rides_free_on_a_decode_batch() -> None:
    """Sarathi-Serve: a decode batch is memory-bound, so prefill tokens piggybacked up
    to the knee cost nothing; the knee of 8B on H200 at batch 1 is 100-200 tokens."""
    assert 100 <= free_chunk_tokens(H200, CTX, 1) <= 200
    for batch in (1, 64, 256):
        free = free_chunk_tokens(H200, batch * CTX, batch)
        decode = H200.step_seconds(batch * CTX, batch, 0.0)
        riding = H200.step_seconds(batch * CTX, batch, H200.prefill_seconds(free, 0))
        assert riding == pytest.approx(decode)
        assert free_chunk_tokens(H200, batch * CTX, batch) >= free_chunk_tokens(H200, CTX, 1)


def test_a_large_chunk_dominates_the_step_and_stalls_its_decodes() -> None:
    """DistServe: a long prefill in the batch stalls every decode in it -- past the knee
    each token adds about ``lin``, and the mixed step costs no more than the sum of a
    decode step and a prefill (less: the weights are read once)."""
    batch = 64
    decode = H200.step_seconds(batch * CTX, batch, 0.0)
    for tokens in (1024, 2048, 8192):
        prefill = H200.prefill_seconds(tokens, 0)
        mixed = H200.step_seconds(batch * CTX, batch, prefill)
        assert mixed > 2 * decode
        assert mixed < decode + prefill
        assert mixed == pytest.approx(H200.a_dec + batch * H200.lin + prefill)


def test_kv_loads_add_to_the_step() -> None:
    assert H200.step_seconds(CTX, 1, 0.0, load=0.01) == pytest.approx(
        H200.step_seconds(CTX, 1, 0.0) + 0.01
    )
    assert H200.step_seconds(0, 0, 0.0, load=0.01) == pytest.approx(H200.a_pf + 0.01)
    assert H200.step_seconds(0, 0, 0.0) == 0.0
