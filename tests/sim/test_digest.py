"""Prompt digests: the engine's opt-in fast path behaves like the tokens it stands for."""

from __future__ import annotations

import dataclasses

import pytest

from pd_orchestrator.sim.blocks import BlockHasher
from pd_orchestrator.sim.digest import PromptDigest
from pd_orchestrator.sim.engine import Engine, EngineRequest
from pd_orchestrator.sim.generation import initial_state
from tests.sim.helpers import Result, make_engine, request, run


def _digest_of(engine: Engine, req: EngineRequest) -> EngineRequest:
    root = initial_state(engine.config.seed, engine.config.model)
    digest = PromptDigest.of_tokens(req.prompt_token_ids, engine.hasher, root)
    return dataclasses.replace(req, prompt_token_ids=(), digest=digest)


def _summary(results: dict[str, Result]) -> dict[str, tuple[object, ...]]:
    return {
        rid: (r.tokens, r.finish_reason, r.cached, r.first_token_at, r.finished_at)
        for rid, r in results.items()
    }


def _waves() -> list[list[EngineRequest]]:
    shared = list(range(300, 340))
    return [
        [request("a", [*shared, 1, 2, 3], 6), request("b", list(range(500, 523)), 5)],
        [request("c", [*shared, 9, 9], 4, cache_hit_threshold=0.8)],
        [request("d", list(range(600, 613)), 3, cache_hit_threshold=0.9)],
    ]


@pytest.mark.parametrize("profile", ["instant", "h200-llama3-8b"])
def test_digest_requests_behave_like_token_requests(profile: str) -> None:
    plain, fast = make_engine(profile), make_engine(profile)
    now = 0.0
    for wave in _waves():
        expected = run(plain, wave, now)
        got = run(fast, [_digest_of(fast, r) for r in wave], now)
        assert _summary(got) == _summary(expected)
        now += 10.0
    assert fast.stats == plain.stats


def test_preempted_digest_requests_match_token_requests() -> None:
    waves = [request(f"r{i}", list(range(400 + 40 * i, 430 + 40 * i)), 24) for i in range(4)]
    plain = make_engine(num_kv_blocks=30)
    fast = make_engine(num_kv_blocks=30)
    expected = run(plain, waves)
    got = run(fast, [_digest_of(fast, r) for r in waves])
    assert plain.stats.preemptions > 0
    assert _summary(got) == _summary(expected)


def test_extend_matches_the_blocks_generation_cached() -> None:
    engine = make_engine()
    first = _digest_of(engine, request("first", list(range(700, 710)), 9))
    out = run(engine, [first])["first"]
    assert first.digest is not None
    continued = first.digest.extend(out.tokens, engine.hasher)
    assert continued.num_tokens == 19
    follow = run(engine, [EngineRequest("next", (), first.sampling, digest=continued)])
    # every full block of prompt + output was cached while the first request ran
    assert follow["next"].cached == 16


def test_extend_equals_of_tokens_of_the_concatenation() -> None:
    hasher = BlockHasher(4)
    head, more = list(range(300, 311)), list(range(900, 907))
    root = initial_state(0, "m")
    extended = PromptDigest.of_tokens(head, hasher, root).extend(more, hasher)
    assert extended == PromptDigest.of_tokens(head + more, hasher, root)


def test_hasher_offset_skips_already_hashed_tokens() -> None:
    hasher = BlockHasher(4)
    tokens = list(range(300, 314))
    full = hasher.extend([], tokens)
    partial = hasher.extend(full[:2], tokens[8:], offset=8)
    assert partial == full
    with pytest.raises(ValueError, match="block boundary"):
        hasher.extend(full[:1], tokens[8:], offset=8)


def test_inconsistent_digest_and_event_recording_are_refused() -> None:
    engine = make_engine()
    bad = PromptDigest(num_tokens=9, block_hashes=(b"x",), tail=(300,), state=1)
    sampling = request("x", [300]).sampling
    with pytest.raises(ValueError, match="does not fit block size 4"):
        engine.add_request(EngineRequest("x", (), sampling, digest=bad))
    recording = make_engine(record_events=True)
    good = PromptDigest(num_tokens=5, block_hashes=(b"x",), tail=(300,), state=1)
    with pytest.raises(ValueError, match="record_events"):
        recording.add_request(EngineRequest("y", (), sampling, digest=good))
    assert EngineRequest("z", (), sampling, digest=good).num_prompt_tokens == 5
