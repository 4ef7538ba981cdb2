"""KV-cache events as vLLM publishes them (pure data; see :mod:`.codec` for the wire).

Field names and order follow vLLM 0.32's ``vllm.distributed.kv_events`` structs.
A block hash is a 64-bit int (vLLM's default) or the digest bytes.
"""

from __future__ import annotations

from dataclasses import field
from typing import Any

from pd_orchestrator.model.records import record

__all__ = [
    "AllBlocksCleared",
    "BlockHash",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "KvEvent",
]

BlockHash = int | bytes


@record
class BlockStored:
    """Blocks newly cached, in chain order; ``parent_block_hash`` precedes the first.

    ``extra_keys`` holds one entry per block: the untagged keys of its hash (LoRA
    name, cache salt) or None.
    """

    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: tuple[tuple[Any, ...] | None, ...] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


@record
class BlockRemoved:
    """Cached blocks evicted."""

    block_hashes: tuple[BlockHash, ...]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


@record
class AllBlocksCleared:
    """The whole prefix cache was reset."""


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


@record
class EventBatch:
    """One published batch: a wall-clock timestamp, events in order, the DP rank.

    ``skipped`` counts events of types this module does not know (decoding only).
    """

    ts: float
    events: tuple[KvEvent, ...]
    data_parallel_rank: int | None = 0
    skipped: int = field(default=0, compare=False)
