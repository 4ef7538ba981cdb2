"""The precise index: events in, consecutive-prefix matches out, and agreement with a
simulated engine's own cache when fed its event stream through the wire format."""

from __future__ import annotations

import random

import pytest

from pd_orchestrator.model.hardware import get_profile
from pd_orchestrator.prefix.codec import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    decode_batch,
    encode_batch,
)
from pd_orchestrator.prefix.hashing import BlockExtras, LoraKey, VllmBlockHasher, external_hash
from pd_orchestrator.prefix.index import PreciseIndex
from pd_orchestrator.sim.engine import Engine, EngineConfig, EngineRequest, SamplingSpec
from pd_orchestrator.sim.kv_events import wire_events

TOKENS = list(range(100, 164))  # four blocks of 16


def stored(hashes: list[bytes], **fields: object) -> BlockStored:
    return BlockStored(tuple(hashes), None, tuple(range(16 * len(hashes))), 16, **fields)  # type: ignore[arg-type]


@pytest.fixture
def index() -> PreciseIndex:
    return PreciseIndex(VllmBlockHasher(16), lora_paths={"sql": "/adapters/sql"})


def test_stored_removed_and_cleared(index: PreciseIndex) -> None:
    digests = index.hasher.block_hashes(TOKENS)
    keys = index.keys(TOKENS)
    assert keys is not None
    index.apply("a", EventBatch(1.0, (stored(digests, medium="GPU"),)))
    index.apply("b", EventBatch(1.0, (stored(digests[:2]),)))
    assert index.match(keys, ["a", "b", "c"]) == {"a": 4, "b": 2, "c": 0}
    index.apply("a", EventBatch(2.0, (BlockRemoved((external_hash(digests[1]),)),)))
    assert index.match(keys, ["a", "b"]) == {"a": 1, "b": 2}
    index.apply("b", EventBatch(3.0, (AllBlocksCleared(),)))
    assert index.match(keys, ["a", "b"]) == {"a": 1, "b": 0}


def test_cached_tokens_are_the_whole_blocks_an_endpoint_holds_in_a_row(
    index: PreciseIndex,
) -> None:
    digests = index.hasher.block_hashes(TOKENS)
    index.apply("a", EventBatch(1.0, (stored([digests[0], digests[1], digests[3]]),)))
    # blocks 0 and 1 in a row (block 3 without block 2 does not count); a partial
    # block past the last whole one is never counted
    assert index.cached_tokens(TOKENS, "a") == 32
    assert index.cached_tokens([*TOKENS[:32], 7, 7], "a") == 32
    assert index.cached_tokens(TOKENS, "b") == 0
    assert index.cached_tokens(TOKENS, "a", "unknown-adapter") is None


def test_one_request_s_prompt_is_hashed_once(index: PreciseIndex) -> None:
    prompt = tuple(TOKENS)
    first = index.keys(prompt)
    assert first is not None and index.keys(prompt) is first  # the scorer, then the planner
    assert index.keys(prompt, cache_salt="t1") != first  # other extras: hashed again
    assert index.keys(tuple(TOKENS)) == first and index.keys(tuple(TOKENS)) is not first
    assert index.keys(TOKENS) is not index.keys(TOKENS)  # a list may change: never kept


def test_int_and_bytes_hashes_index_alike(index: PreciseIndex) -> None:
    digests = index.hasher.block_hashes(TOKENS)
    index.apply("bytes", EventBatch(1.0, (stored(digests),)))
    index.apply("ints", EventBatch(1.0, (stored([external_hash(d) for d in digests]),)))  # type: ignore[list-item]
    keys = index.keys(TOKENS)
    assert keys is not None
    assert index.match(keys, ["bytes", "ints"]) == {"bytes": 4, "ints": 4}


@pytest.mark.parametrize(
    "event",
    [
        stored([b"x" * 32], medium="CPU"),
        stored([b"x" * 32], group_idx=1),
        BlockStored((b"x" * 32,), None, tuple(range(32)), 32),
    ],
    ids=["other-medium", "other-group", "other-block-size"],
)
def test_events_that_do_not_describe_the_gpu_cache_are_ignored(
    index: PreciseIndex, event: BlockStored
) -> None:
    index.apply("a", EventBatch(1.0, (event,)))
    assert index.stats().keys == 0
    assert index.stats().ignored_events == 1


def test_lora_and_cache_salt_keys(index: PreciseIndex) -> None:
    extras = BlockExtras(LoraKey("sql", "/adapters/sql"), cache_salt="t1")
    digests = index.hasher.block_hashes(TOKENS, extras)
    index.apply("a", EventBatch(1.0, (stored(digests, lora_name="sql"),)))
    base, salted, other_salt = (
        index.keys(TOKENS),
        index.keys(TOKENS, "sql", "t1"),
        index.keys(TOKENS, "sql", "t2"),
    )
    assert base is not None and salted is not None and other_salt is not None
    assert index.match(salted, ["a"]) == {"a": 4}
    assert index.match(base, ["a"]) == {"a": 0}
    assert index.match(other_salt, ["a"]) == {"a": 0}
    assert index.keys(TOKENS, "unknown-adapter") is None


def test_capacity_bounds_each_endpoint() -> None:
    index = PreciseIndex(VllmBlockHasher(16), capacity_per_endpoint=3)
    digests = index.hasher.block_hashes(TOKENS)
    index.apply("a", EventBatch(1.0, (stored(digests),)))
    stats = index.stats()
    assert stats.entries == 3 and stats.evictions == 1
    assert stats.memory_bytes > 0


def test_drop_forgets_an_endpoint(index: PreciseIndex) -> None:
    index.apply("a", EventBatch(1.0, (stored(index.hasher.block_hashes(TOKENS)),)))
    assert index.drop("a") == 4
    assert index.stats().keys == 0


def engine(blocks: int) -> Engine:
    config = EngineConfig(
        profile=get_profile("instant"),
        model="m",
        block_size=16,
        num_kv_blocks=blocks,
        record_events=True,
    )
    return Engine(config)


def run_to_completion(sim: Engine, now: float = 0.0) -> None:
    while sim.has_work():
        now += sim.step(now).duration


def drain(sim: Engine, index: PreciseIndex, name: str, *, int_hashes: bool) -> set[str]:
    """The engine's events, through the wire format, into the index; their types."""
    events, sim.pool.events = sim.pool.events, []
    payload = encode_batch(EventBatch(0.0, wire_events(events, int_hashes=int_hashes)))
    batch = decode_batch(payload)
    index.apply(name, batch)
    return {type(event).__name__ for event in batch.events}


@pytest.mark.parametrize("int_hashes", [True, False], ids=["int-hashes", "bytes-hashes"])
def test_index_tracks_a_simulated_engine(int_hashes: bool) -> None:
    """Shared-prefix prompts through a small cache (stores and evictions), then a
    reset (all cleared): the index agrees with the engine's own lookups throughout."""
    rng = random.Random(7)
    sim = engine(blocks=64)
    index = PreciseIndex(sim.hasher)
    prefixes = [[rng.randrange(300, 30_000) for _ in range(160)] for _ in range(4)]
    seen: set[str] = set()
    for n in range(40):
        prompt = rng.choice(prefixes)[: rng.randrange(40, 160)] + [rng.randrange(300, 999)] * 5
        sampling = SamplingSpec(max_tokens=rng.randrange(1, 20), ignore_eos=True)
        sim.add_request(EngineRequest(f"r{n}", prompt, sampling))
        run_to_completion(sim)
        seen |= drain(sim, index, "sim", int_hashes=int_hashes)
        for probe in prefixes:
            keys = index.keys(probe)
            assert keys is not None
            held = index.match(keys, ["sim"])["sim"]
            assert held * 16 == sim.local_hit_tokens([*probe, 0])
    assert seen == {"BlockStored", "BlockRemoved"}
    assert index.stats().ignored_events == 0
    assert any(sim.pool.longest_hit(sim.prompt_hashes(p), 99) for p in prefixes)
    assert sim.reset_prefix_cache()
    assert drain(sim, index, "sim", int_hashes=int_hashes) == {"AllBlocksCleared"}
    assert index.stats().keys == 0
