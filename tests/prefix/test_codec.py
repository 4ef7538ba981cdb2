"""The KV-event wire format: vLLM 0.32's exact bytes, older array-encoded events,
round trips and malformed payloads."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pd_orchestrator.prefix.codec import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    EventDecodeError,
    decode_batch,
    decode_seq,
    encode_batch,
    encode_seq,
)

# The payload vLLM 0.32's publisher (msgspec) writes for GOLDEN_BATCH below.
GOLDEN_PAYLOAD = bytes.fromhex(
    "93cb41d98414939000009489a474797065ab426c6f636b53746f726564ac626c6f636b5f686173686573"
    "92cf1a1eb4e3edd9361acfffffffffffffffffb1706172656e745f626c6f636b5f68617368c0a9746f6b"
    "656e5f696473980102030405060708aa626c6f636b5f73697a6504a76c6f72615f6964c0a66d65646975"
    "6da3475055a96c6f72615f6e616d65c0a967726f75705f696478008aa474797065ab426c6f636b53746f"
    "726564ac626c6f636b5f68617368657391c42001010101010101010101010101010101010101010101010"
    "10101010101010101b1706172656e745f626c6f636b5f6861736807a9746f6b656e5f69647392cd012cce"
    "00011170aa626c6f636b5f73697a6502a76c6f72615f696403a66d656469756da3475055a96c6f72615f"
    "6e616d65a373716caa65787472615f6b6579739192a373716ca473616c74a967726f75705f6964780084"
    "a474797065ac426c6f636b52656d6f766564ac626c6f636b5f68617368657391cf1a1eb4e3edd9361aa6"
    "6d656469756da3475055a967726f75705f6964780081a474797065b0416c6c426c6f636b73436c656172"
    "656400"
)
GOLDEN_BATCH = EventBatch(
    ts=1712345678.25,
    events=(
        BlockStored(
            block_hashes=(1882140585328457242, 2**64 - 1),
            parent_block_hash=None,
            token_ids=(1, 2, 3, 4, 5, 6, 7, 8),
            block_size=4,
            medium="GPU",
            group_idx=0,
        ),
        BlockStored(
            block_hashes=(b"\x01" * 32,),
            parent_block_hash=7,
            token_ids=(300, 70000),
            block_size=2,
            lora_id=3,
            medium="GPU",
            lora_name="sql",
            extra_keys=(("sql", "salt"),),
            group_idx=0,
        ),
        BlockRemoved(block_hashes=(1882140585328457242,), medium="GPU", group_idx=0),
        AllBlocksCleared(),
    ),
    data_parallel_rank=0,
)


def test_encoding_is_byte_identical_to_vllm() -> None:
    assert encode_batch(GOLDEN_BATCH) == GOLDEN_PAYLOAD


def test_decoding_vllm_bytes() -> None:
    assert decode_batch(GOLDEN_PAYLOAD) == GOLDEN_BATCH


def test_array_encoded_events_of_older_servers_decode() -> None:
    payload = msgpack.packb(
        [
            3.5,
            [
                ["BlockStored", [11, 12], None, [1, 2, 3, 4], 2, None, "GPU"],
                ["BlockRemoved", [11]],
                ["AllBlocksCleared"],
            ],
        ]
    )
    batch = decode_batch(payload)
    assert batch.data_parallel_rank is None
    assert batch.events == (
        BlockStored((11, 12), None, (1, 2, 3, 4), 2, None, "GPU"),
        BlockRemoved((11,)),
        AllBlocksCleared(),
    )


def test_unknown_event_types_and_fields_are_skipped() -> None:
    payload = msgpack.packb(
        [
            1.0,
            [
                {"type": "BlockMoved", "block_hashes": [1]},
                {"type": "BlockRemoved", "block_hashes": [1], "medium": None, "tier": 2},
            ],
            0,
        ]
    )
    batch = decode_batch(payload)
    assert batch.events == (BlockRemoved((1,)),)
    assert batch.skipped == 1


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1",
        msgpack.packb({"nope": 1}),
        msgpack.packb([1.0]),
        msgpack.packb(["later", []]),
        msgpack.packb([1.0, {}]),
        msgpack.packb([1.0, [{"type": "BlockRemoved", "block_hashes": ["x"]}]]),
        msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [1]}]]),
        msgpack.packb([1.0, [{"type": "BlockRemoved", "block_hashes": [1], "medium": []}]]),
        msgpack.packb([1.0, [7]]),
        msgpack.packb([1.0, [], "rank"]),
    ],
    ids=[
        "not-msgpack",
        "map-without-fields",
        "short-array",
        "string-ts",
        "events-not-array",
        "string-hash",
        "stored-without-tokens",
        "list-medium",
        "event-not-map",
        "string-rank",
    ],
)
def test_malformed_payloads_raise(payload: bytes) -> None:
    with pytest.raises(EventDecodeError):
        decode_batch(payload)


hashes = st.one_of(st.integers(0, 2**64 - 1), st.binary(min_size=8, max_size=32))
stored = st.builds(
    BlockStored,
    block_hashes=st.lists(hashes, min_size=1, max_size=4).map(tuple),
    parent_block_hash=st.none() | hashes,
    token_ids=st.lists(st.integers(0, 2**31), max_size=16).map(tuple),
    block_size=st.integers(1, 64),
    lora_id=st.none() | st.integers(0, 100),
    medium=st.sampled_from([None, "GPU", "CPU"]),
    lora_name=st.none() | st.text(max_size=8),
    extra_keys=st.none()
    | st.lists(st.none() | st.tuples(st.text(max_size=5)), min_size=1, max_size=3).map(tuple),
    group_idx=st.none() | st.integers(0, 3),
)
removed = st.builds(
    BlockRemoved,
    block_hashes=st.lists(hashes, min_size=1, max_size=4).map(tuple),
    medium=st.sampled_from([None, "GPU"]),
)
events = st.lists(st.one_of(stored, removed, st.just(AllBlocksCleared())), max_size=5)


@given(
    ts=st.floats(0, 2e9),
    events=events,
    rank=st.none() | st.integers(0, 7),
)
def test_round_trip(ts: float, events: list[BlockStored], rank: int | None) -> None:
    batch = EventBatch(ts, tuple(events), rank)
    assert decode_batch(encode_batch(batch)) == batch


def test_sequence_frames() -> None:
    assert encode_seq(258) == b"\x00" * 6 + b"\x01\x02"
    assert decode_seq(encode_seq(2**40)) == 2**40
    assert decode_seq(END_SEQ) == -1
    with pytest.raises(EventDecodeError):
        decode_seq(b"\x01")
