"""Engine behaviours: prefix cache (the nanoGPT write-up's tests), threshold, preemption."""

from __future__ import annotations

import pytest

from pd_orchestrator.sim.engine import Engine, FinishReason, hit_ratio
from pd_orchestrator.sim.generation import advance_all, initial_state, next_token
from pd_orchestrator.sim.kvstore import SharedKVStore
from pd_orchestrator.sim.tokenizer import EOS_TOKEN_ID

from .helpers import TOK, Result, make_engine, request, run

# -- the nanoGPT prefix-caching tests, as engine behaviours (block size 4) --------------


def test_identical_prefixes_hit_every_full_block() -> None:
    engine = make_engine()
    prompt = "To be or not to be"  # 18 tokens: 4 full blocks
    first = run(engine, [request("a", prompt, 20)])["a"]
    cached_after_first = engine.pool.num_cached
    second = run(engine, [request("b", prompt, 20)])["b"]
    assert first.cached == 0
    assert second.cached == 16
    assert second.tokens == first.tokens
    assert engine.pool.num_cached == cached_after_first  # no duplicate blocks


def test_shared_prefix_with_different_suffixes_reuses_only_the_prefix() -> None:
    engine = make_engine()
    shared = "Hello world "
    assert len(TOK.encode(shared)) == 12
    run(engine, [request("cat", shared + "cat", 10)])
    dog = run(engine, [request("dog", shared + "dog", 10)])["dog"]
    assert dog.cached == 12


def test_no_shared_prefix_means_no_hit_and_separate_blocks() -> None:
    engine = make_engine()
    run(engine, [request("a", "The cat sat on the mat", 10)])
    cached_a = engine.pool.num_cached
    b = run(engine, [request("b", "Once upon a midnight", 10)])["b"]
    assert b.cached == 0
    assert engine.pool.num_cached >= cached_a + len(TOK.encode("Once upon a midnight")) // 4


def test_lru_eviction_under_pressure_keeps_the_most_recent_prefix() -> None:
    engine = make_engine(num_kv_blocks=12)
    prompts = {name: f"{name} " + "x" * 13 for name in ("AAAA", "BBBB", "CCCC")}  # 18 tokens
    for name, prompt in prompts.items():
        run(engine, [request(name, prompt, 1)])
    again_a = run(engine, [request("a2", prompts["AAAA"], 1)])["a2"]
    again_c = run(engine, [request("c2", prompts["CCCC"], 1)])["c2"]
    # 12 blocks hold two 5-block prompts: C's allocation evicted A's tail blocks first
    # (freed blocks queue in reverse order), so only A's first two blocks survive.
    assert again_a.cached == 8
    assert again_c.cached == 16


def test_decode_blocks_are_cached_so_the_next_turn_hits_the_answer() -> None:
    engine = make_engine()
    prompt = TOK.encode("user: tell me a story\nassistant:")
    answer = run(engine, [request("t1", prompt, 24)])["t1"].tokens
    turn2 = prompt + answer + TOK.encode("\nuser: more\nassistant:")
    res = run(engine, [request("t2", turn2, 4)])["t2"]
    assert res.cached >= (len(prompt) + len(answer) - 1) // 4 * 4


# -- threshold (RFC 24256) -----------------------------------------------------------------


def test_cold_prompt_below_threshold_is_rejected_without_allocating() -> None:
    engine = make_engine()
    res = run(engine, [request("a", "a cold prompt of some length", 8, cache_hit_threshold=0.5)])
    assert res["a"].finish_reason is FinishReason.CACHE_THRESHOLD
    assert res["a"].tokens == []
    assert engine.pool.num_cached == 0
    assert engine.stats.threshold_rejections_admission == 1


def test_warm_prompt_above_threshold_is_admitted() -> None:
    engine = make_engine()
    prompt = "a warm prompt that was seen before!"
    run(engine, [request("warm", prompt, 4)])
    res = run(engine, [request("a", prompt, 4, cache_hit_threshold=0.8)])["a"]
    assert res.finish_reason is FinishReason.LENGTH
    assert len(res.tokens) == 4


def test_ratio_equal_to_threshold_is_admitted() -> None:
    engine = make_engine()
    prompt = TOK.encode("x" * 17)  # 17 tokens; 16 cacheable
    run(engine, [request("warm", prompt, 1)])
    res = run(engine, [request("a", prompt, 1, cache_hit_threshold=16 / 17)])["a"]
    assert res.finish_reason is FinishReason.LENGTH


def test_block_granularity_caps_the_ratio() -> None:
    engine = make_engine()
    prompt = TOK.encode("y" * 16)  # fully cached, but the last token is always recomputed
    run(engine, [request("warm", prompt, 1)])
    assert engine.local_hit_tokens(prompt) == 12
    res = run(engine, [request("a", prompt, 1, cache_hit_threshold=0.76)])["a"]
    assert res.finish_reason is FinishReason.CACHE_THRESHOLD


@pytest.mark.parametrize(
    ("global_value", "per_request", "expected"),
    [
        (0.5, None, FinishReason.CACHE_THRESHOLD),
        (0.5, 0.0, FinishReason.LENGTH),
        (0.0, 0.5, FinishReason.CACHE_THRESHOLD),
        (0.0, None, FinishReason.LENGTH),
    ],
    ids=["global-rejects", "request-overrides-global", "request-rejects", "none"],
)
def test_per_request_threshold_overrides_the_global_one(
    global_value: float, per_request: float | None, expected: FinishReason
) -> None:
    engine = make_engine(global_cache_hit_threshold=global_value)
    res = run(engine, [request("a", "cold prompt", 2, cache_hit_threshold=per_request)])["a"]
    assert res.finish_reason is expected


def test_threshold_is_ignored_for_prefill_requests() -> None:
    engine = make_engine(global_cache_hit_threshold=1.0)
    res = run(engine, [request("p", "cold", 1, cache_hit_threshold=1.0, do_remote_decode=True)])
    assert res["p"].finish_reason is FinishReason.LENGTH


def test_forced_rejection() -> None:
    engine = make_engine()
    prompt = "seen before, fully cached"
    run(engine, [request("warm", prompt, 1)])
    res = run(engine, [request("a", prompt, 1, force_reject=True)])["a"]
    assert res.finish_reason is FinishReason.CACHE_THRESHOLD


def test_empty_prompt_never_divides_by_zero() -> None:
    assert hit_ratio(0, 0) == 1.0
    with pytest.raises(ValueError, match="empty"):
        make_engine().add_request(request("e", [], 3, cache_hit_threshold=1.0))


def test_external_tokens_count_towards_the_ratio_and_the_cached_tokens() -> None:
    engine = make_engine(kv_connector="nixl")
    prompt = TOK.encode("z" * 33)
    res = run(engine, [request("d", prompt, 2, cache_hit_threshold=0.9, external_tokens=33)])["d"]
    assert res.finish_reason is FinishReason.LENGTH
    assert res.external == 32 and res.cached == 32  # the last token is recomputed
    assert engine.stats.external_hits == 32


def test_shared_storage_loads_a_prompt_saved_by_another_engine() -> None:
    keys: set[str] = set()
    producer = make_engine()
    producer.external = SharedKVStore(keys, 4)
    consumer = make_engine(kv_connector="example")
    consumer.external = SharedKVStore(keys, 4)
    prompt = "a prompt stored on shared storage"
    run(producer, [request("p", prompt, 1, do_remote_decode=True)])
    res = run(consumer, [request("d", prompt, 2, cache_hit_threshold=0.8)])["d"]
    n = len(TOK.encode(prompt))
    assert res.finish_reason is FinishReason.LENGTH
    assert res.external == (n - 1) // 4 * 4


# -- preemption -------------------------------------------------------------------------------


def _long_prompt(i: int) -> list[int]:
    return TOK.encode(f"request number {i} with a long prompt")


def _pressure(
    num_blocks: int, threshold: float | None, *, admission_only: bool = False
) -> tuple[dict[str, Result], Engine]:
    """Four concurrent 40-token generations whose KV arrived from a prefiller."""
    engine = make_engine(num_kv_blocks=num_blocks, kv_connector="nixl")
    reqs = [
        request(
            f"r{i}",
            _long_prompt(i),
            40,
            cache_hit_threshold=threshold,
            admission_only=admission_only,
            external_tokens=len(_long_prompt(i)),
        )
        for i in range(4)
    ]
    return run(engine, reqs), engine


def _solo(i: int) -> list[int]:
    return run(make_engine(), [request("solo", _long_prompt(i), 40)])["solo"].tokens


def test_preempted_request_without_threshold_recomputes_to_the_same_tokens() -> None:
    results, engine = _pressure(40, None)
    assert engine.stats.preemptions > 0
    for i in range(4):
        res = results[f"r{i}"]
        assert res.finish_reason is FinishReason.LENGTH
        assert res.tokens == _solo(i)


def test_preempted_request_below_threshold_is_handed_back_with_its_tokens() -> None:
    results, engine = _pressure(40, 0.9)
    handed_back = {
        rid: res
        for rid, res in results.items()
        if res.finish_reason is FinishReason.CACHE_THRESHOLD
    }
    assert handed_back, "expected at least one hand-back"
    assert engine.stats.threshold_rejections_preemption == len(handed_back)
    assert engine.stats.threshold_rejections_admission == 0
    for rid, res in handed_back.items():
        generated = res.tokens
        assert 0 < len(generated) < 40
        assert generated == _solo(int(rid[1:]))[: len(generated)]


def test_a_preempted_admission_only_request_recomputes_and_is_never_handed_back() -> None:
    results, engine = _pressure(40, 0.9, admission_only=True)
    assert engine.stats.preemptions > 0  # the same pressure as the hand-back case
    assert engine.stats.threshold_rejections_preemption == 0
    for i in range(4):
        res = results[f"r{i}"]
        assert res.finish_reason is FinishReason.LENGTH
        assert res.tokens == _solo(i)


def test_an_admission_only_request_is_still_checked_at_admission() -> None:
    engine = make_engine()
    cold = request("cold", _long_prompt(9), 4, cache_hit_threshold=0.5, admission_only=True)
    assert run(engine, [cold])["cold"].finish_reason is FinishReason.CACHE_THRESHOLD
    assert engine.stats.threshold_rejections_admission == 1


# -- producer leases ----------------------------------------------------------------------


def test_producer_holds_its_blocks_until_released() -> None:
    engine = make_engine()
    res = run(engine, [request("p", "prefill this prompt please", 1, do_remote_decode=True)])["p"]
    assert res.transfer is not None
    assert engine.pool.usage > 0 and engine.num_held == 1
    held = engine.release("p")
    assert held is not None and held.num_tokens == len(TOK.encode("prefill this prompt please"))
    assert engine.pool.usage == 0 and engine.num_held == 0
    assert engine.release("p") is None


def test_producer_lease_expires() -> None:
    engine = make_engine(lease_seconds=30.0)
    run(engine, [request("p", "prefill this prompt please", 1, do_remote_decode=True)], now=100.0)
    assert engine.next_deadline() == pytest.approx(130.0)
    engine.step(129.0)
    assert engine.num_held == 1
    engine.step(130.0)
    assert engine.num_held == 0 and engine.pool.usage == 0


def _prompt_whose_first_token_is_eos() -> list[int]:
    root = initial_state(0, "m")
    for i in range(10_000):
        prompt = TOK.encode(f"prompt {i}")
        if next_token(advance_all(root, prompt), allow_eos=True) == EOS_TOKEN_ID:
            return prompt
    raise AssertionError("no prompt found")


def test_producer_that_ends_on_eos_returns_no_transfer() -> None:
    engine = make_engine()
    prompt = _prompt_whose_first_token_is_eos()
    res = run(engine, [request("p", prompt, 1, ignore_eos=False, do_remote_decode=True)])["p"]
    assert res.finish_reason is FinishReason.STOP
    assert res.tokens == [EOS_TOKEN_ID]
    assert res.transfer is None and engine.num_held == 0


# -- latency model and batching ---------------------------------------------------------------


def test_prefill_latency_follows_the_h200_calibration() -> None:
    engine = make_engine("h200-llama3-8b", block_size=16, num_kv_blocks=4096)
    two_k = run(engine, [request("a", list(range(300, 2348)), 1)])["a"]
    assert two_k.first_token_at == pytest.approx(0.070, rel=0.03)
    warm = run(engine, [request("b", list(range(300, 2348)), 1)], now=10.0)["b"]
    assert warm.first_token_at is not None and warm.first_token_at - 10.0 < 0.012


def test_chunked_prefill_splits_a_long_prompt_over_steps() -> None:
    engine = make_engine(max_num_batched_tokens=64)
    engine.add_request(request("a", list(range(300, 500)), 1))
    steps = 0
    while engine.has_work():
        engine.step(0.0)
        steps += 1
    assert steps == 4  # 200 prompt tokens in chunks of 64


def test_max_num_seqs_bounds_the_running_batch() -> None:
    engine = make_engine(max_num_seqs=2)
    for i in range(5):
        engine.add_request(request(f"r{i}", f"prompt {i}", 4))
    engine.step(0.0)
    assert engine.num_running == 2 and engine.num_waiting == 3
