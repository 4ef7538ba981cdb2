"""vLLM's KV-event wire format: msgpack batches of tagged events (pure).

A ZMQ message of vLLM's publisher has three frames: the topic, the sequence number
(8 bytes, big-endian) and the payload. The payload is a msgpack *array*
``[ts, events, data_parallel_rank]`` (an ``array_like`` msgspec struct). Each event
is a tagged msgspec struct with ``omit_defaults``; vLLM 0.32 encodes it as a map
whose first key is ``"type"`` (the class name), then its fields in declaration
order, fields without a default always present, defaulted fields only when set::

    BlockStored:  block_hashes, parent_block_hash, token_ids, block_size, lora_id,
                  medium, lora_name, [extra_keys, group_idx, kv_cache_spec_kind,
                  kv_cache_spec_sliding_window, locality, ownership, session_id]
    BlockRemoved: block_hashes, medium, [group_idx, locality, ownership]
    AllBlocksCleared: (no fields)

Older servers encoded events as arrays ``[tag, field, ...]`` in the same field
order; :func:`decode_batch` reads both forms and skips events of unknown type. A
block hash is a 64-bit unsigned int (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``, the
default) or the digest bytes. :func:`encode_batch` writes exactly what vLLM 0.32
writes for the same batch.

The replay socket (ROUTER) takes a request frame holding the first wanted sequence
number (8 bytes, big-endian) and answers with one ``[topic, seq, payload]`` message
per buffered batch from there on, then ``[b"", END_SEQ, b""]``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import MISSING, fields
from typing import Any

import msgpack

from pd_orchestrator.prefix.events import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KvEvent,
)

__all__ = [
    "END_SEQ",
    "AllBlocksCleared",
    "BlockHash",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "EventDecodeError",
    "KvEvent",
    "decode_batch",
    "decode_seq",
    "encode_batch",
    "encode_seq",
]

END_SEQ = (-1).to_bytes(8, "big", signed=True)


class EventDecodeError(ValueError):
    """A payload that is not a vLLM KV-event batch; the message says what is wrong."""


# Fields without a default in vLLM's structs: always on the wire, even when None.
_REQUIRED: dict[type[KvEvent], frozenset[str]] = {
    BlockStored: frozenset(
        [
            "block_hashes",
            "parent_block_hash",
            "token_ids",
            "block_size",
            "lora_id",
            "medium",
            "lora_name",
        ]
    ),
    BlockRemoved: frozenset(("block_hashes", "medium")),
    AllBlocksCleared: frozenset(),
}
_TYPES: dict[str, type[KvEvent]] = {
    "BlockStored": BlockStored,
    "BlockRemoved": BlockRemoved,
    "AllBlocksCleared": AllBlocksCleared,
}


def encode_seq(seq: int) -> bytes:
    """A sequence-number frame (8 bytes, big-endian)."""
    return seq.to_bytes(8, "big")


def decode_seq(frame: bytes) -> int:
    """The sequence number of a frame; -1 for :data:`END_SEQ`."""
    if len(frame) != 8:
        raise EventDecodeError(f"a sequence frame has 8 bytes, not {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)


def _wire_value(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_wire_value(v) if isinstance(v, tuple) else v for v in value]
    return value


def _event_map(event: KvEvent) -> dict[str, Any]:
    required = _REQUIRED[type(event)]
    wire: dict[str, Any] = {"type": type(event).__name__}
    for f in fields(event):
        value = getattr(event, f.name)
        if f.name in required or value is not None:
            wire[f.name] = _wire_value(value)
    return wire


def encode_batch(batch: EventBatch) -> bytes:
    """The msgpack payload of ``batch``, byte for byte as vLLM 0.32 encodes it."""
    events = [_event_map(event) for event in batch.events]
    packed = msgpack.packb([float(batch.ts), events, batch.data_parallel_rank], use_bin_type=True)
    assert isinstance(packed, bytes)
    return packed


def decode_batch(payload: bytes) -> EventBatch:
    """The batch in ``payload`` (map- or array-encoded events, int or bytes hashes).

    Raises :class:`EventDecodeError` for anything that is not a batch of well-typed
    events; events of unknown type are skipped and counted in ``skipped``.
    """
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise EventDecodeError(f"not msgpack: {exc}") from None
    ts, raw_events, rank = _batch_fields(raw)
    events: list[KvEvent] = []
    skipped = 0
    for raw_event in raw_events:
        event = _decode_event(raw_event)
        if event is None:
            skipped += 1
        else:
            events.append(event)
    return EventBatch(ts, tuple(events), rank, skipped)


def _batch_fields(raw: Any) -> tuple[float, list[Any], int | None]:
    if isinstance(raw, Mapping):
        raw = [raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")]
    if not isinstance(raw, list) or len(raw) < 2:
        raise EventDecodeError("a batch is an array [ts, events, data_parallel_rank]")
    ts, raw_events = raw[0], raw[1]
    rank = raw[2] if len(raw) > 2 else None
    if not isinstance(ts, int | float) or isinstance(ts, bool):
        raise EventDecodeError(f"batch ts must be a number, not {type(ts).__name__}")
    if not isinstance(raw_events, list):
        raise EventDecodeError("batch events must be an array")
    if rank is not None and (not isinstance(rank, int) or isinstance(rank, bool)):
        raise EventDecodeError("data_parallel_rank must be an int or nil")
    return float(ts), raw_events, rank


def _decode_event(raw: Any) -> KvEvent | None:
    if isinstance(raw, Mapping):
        tag, values = raw.get("type"), dict(raw)
        values.pop("type", None)
    elif isinstance(raw, list) and raw:
        tag = raw[0]
        cls = _TYPES.get(tag) if isinstance(tag, str) else None
        names = [f.name for f in fields(cls)] if cls is not None else []
        values = dict(zip(names, raw[1:], strict=False))
    else:
        raise EventDecodeError("an event is a map with a 'type' or an array [tag, ...]")
    cls = _TYPES.get(tag) if isinstance(tag, str) else None
    if cls is None:
        return None
    return _build(cls, values)


def _build(cls: type[KvEvent], values: dict[str, Any]) -> KvEvent:
    known = {f.name for f in fields(cls)}
    missing = [f.name for f in fields(cls) if f.default is MISSING and f.name not in values]
    if missing:
        raise EventDecodeError(f"{cls.__name__} lacks {', '.join(missing)}")
    kwargs: dict[str, Any] = {}
    for name, value in values.items():
        if name in known:
            kwargs[name] = _CHECKS.get(name, _optional_scalar)(name, value)
    return cls(**kwargs)


def _hashes(name: str, value: Any) -> tuple[BlockHash, ...]:
    if not isinstance(value, list) or not all(_is_hash(v) for v in value):
        raise EventDecodeError(f"{name} must be an array of ints or bytes")
    return tuple(value)


def _is_hash(value: Any) -> bool:
    return isinstance(value, bytes) or (isinstance(value, int) and not isinstance(value, bool))


def _parent(name: str, value: Any) -> BlockHash | None:
    if value is not None and not _is_hash(value):
        raise EventDecodeError(f"{name} must be an int, bytes or nil")
    return value  # type: ignore[no-any-return]


def _ints(name: str, value: Any) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        raise EventDecodeError(f"{name} must be an array of ints")
    return tuple(value)


def _extra_keys(name: str, value: Any) -> tuple[tuple[Any, ...] | None, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise EventDecodeError(f"{name} must be an array or nil")
    return tuple(None if keys is None else tuple(_as_list(name, keys)) for keys in value)


def _as_list(name: str, value: Any) -> list[Any]:
    if not isinstance(value, list):
        raise EventDecodeError(f"{name} entries must be arrays or nil")
    return value


def _optional_scalar(name: str, value: Any) -> Any:
    if value is not None and not isinstance(value, str | int | float):
        raise EventDecodeError(f"{name} must be a scalar or nil")
    return value


def _block_size(name: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise EventDecodeError(f"{name} must be a positive int")
    return value


_CHECKS: dict[str, Callable[[str, Any], Any]] = {
    "block_hashes": _hashes,
    "parent_block_hash": _parent,
    "token_ids": _ints,
    "block_size": _block_size,
    "extra_keys": _extra_keys,
}
