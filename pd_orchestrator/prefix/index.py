"""The precise prefix index: what each endpoint's KV cache holds, from its KV events.

Fed with the decoded event batches of every endpoint (:meth:`PreciseIndex.apply`),
the index keeps block key -> endpoints (a :class:`~pd_orchestrator.prefix.table.BlockTable`):

* ``BlockStored`` adds the event's block keys to the endpoint, ``BlockRemoved``
  removes them, ``AllBlocksCleared`` empties the endpoint;
* only events of the configured media (default ``GPU``; events without a medium
  count as GPU) and of KV-cache group 0 (or no group) count, and a ``BlockStored``
  whose ``block_size`` differs from the index's is ignored and counted;
* keys are the 64-bit form of the hashes (:func:`~pd_orchestrator.prefix.hashing.external_hash`),
  so int- and bytes-hash publishers index alike.

A request is matched by hashing its token ids exactly as vLLM does (same block
size, hash algorithm and seed) with its extra keys: the LoRA adapter (name and
the path the servers loaded it from: ``lora_paths``) and the cache salt. Blocks
stored under another adapter or salt therefore never match. A request naming an
adapter whose path is not configured cannot be hashed (:meth:`PreciseIndex.keys`
returns None). At most ``max_request_blocks`` leading blocks are hashed.

Memory is bounded: at most ``capacity_per_endpoint`` keys per endpoint (the least
recently stored go first, which only happens when events were lost).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from pd_orchestrator.model.records import record
from pd_orchestrator.prefix.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KvEvent,
)
from pd_orchestrator.prefix.hashing import BlockExtras, LoraKey, VllmBlockHasher, external_hash
from pd_orchestrator.prefix.pending import PendingBlocks
from pd_orchestrator.prefix.table import BlockTable

__all__ = ["IndexStats", "PreciseIndex"]


@record
class IndexStats:
    """Counters of a :class:`PreciseIndex`."""

    keys: int
    entries: int
    endpoints: int
    memory_bytes: int
    events: int
    ignored_events: int
    evictions: int


class PreciseIndex:
    """Block key -> endpoints from KV events; see the module docstring."""

    def __init__(
        self,
        hasher: VllmBlockHasher,
        *,
        capacity_per_endpoint: int = 262_144,
        media: Iterable[str] = ("GPU",),
        lora_paths: Mapping[str, str] | None = None,
        max_request_blocks: int = 8192,
    ) -> None:
        if max_request_blocks < 1:
            raise ValueError("max_request_blocks must be >= 1")
        self.hasher = hasher
        self.table = BlockTable(capacity_per_endpoint)
        self.media = frozenset(m.upper() for m in media)
        self.lora_paths = dict(lora_paths or {})
        self.max_request_blocks = max_request_blocks
        self.events = 0
        self.ignored_events = 0
        self._last: tuple[tuple[int, ...], str | None, str | None, list[int] | None] | None = None

    @property
    def block_size(self) -> int:
        return self.hasher.block_size

    # -- updates -------------------------------------------------------------------
    def apply(self, endpoint: str, batch: EventBatch) -> None:
        """Apply every event of ``batch`` (published by ``endpoint``) in order."""
        for event in batch.events:
            self.apply_event(endpoint, event)

    def apply_event(self, endpoint: str, event: KvEvent) -> None:
        """Apply one event of ``endpoint``."""
        self.events += 1
        if isinstance(event, AllBlocksCleared):
            self.table.clear(endpoint)
        elif not self._counts(event):
            self.ignored_events += 1
        elif isinstance(event, BlockStored):
            self.table.add(endpoint, [external_hash(h) for h in event.block_hashes])
        else:
            self.table.remove(endpoint, [external_hash(h) for h in event.block_hashes])

    def _counts(self, event: BlockStored | BlockRemoved) -> bool:
        medium = (event.medium or "GPU").upper()
        if medium not in self.media or event.group_idx not in (None, 0):
            return False
        return not isinstance(event, BlockStored) or event.block_size == self.block_size

    def drop(self, endpoint: str) -> int:
        """Forget everything ``endpoint`` held (its stream was lost); returns the count."""
        return self.table.clear(endpoint)

    # -- queries -------------------------------------------------------------------
    def extras(self, lora: str | None, cache_salt: str | None) -> BlockExtras | None:
        """The hash extras of a request; ``KeyError`` for an adapter without a path."""
        key = None if lora is None else LoraKey(lora, self.lora_paths[lora])
        if key is None and not cache_salt:
            return None
        return BlockExtras(key, cache_salt or None)

    def keys(
        self, token_ids: Sequence[int], lora: str | None = None, cache_salt: str | None = None
    ) -> list[int] | None:
        """The block keys of a prompt; None when its adapter's path is unknown. The last
        tuple of ids asked about is remembered (by identity), so the routing's scorer
        and the planner's cached count of one request hash its prompt once; the
        returned list is shared, not to be changed."""
        last = self._last
        if last is not None and last[0] is token_ids and last[1:3] == (lora, cache_salt):
            return last[3]
        try:
            extras = self.extras(lora, cache_salt)
        except KeyError:
            keys = None
        else:
            keys = self.hasher.keys(token_ids, extras, self.max_request_blocks)
        if isinstance(token_ids, tuple):
            self._last = (token_ids, lora, cache_salt, keys)
        return keys

    def match(self, keys: Sequence[int], endpoints: Iterable[str]) -> dict[str, int]:
        """Leading blocks of ``keys`` each endpoint holds in a row."""
        return self.table.prefix_lengths(keys, endpoints)

    def cached_tokens(
        self,
        token_ids: Sequence[int],
        endpoint: str,
        lora: str | None = None,
        cache_salt: str | None = None,
        pending: PendingBlocks[int] | None = None,
    ) -> int | None:
        """Leading tokens of a prompt whose blocks ``endpoint`` holds in a row, or that
        its prompts in flight hold (``pending``), the more (whole blocks, at most
        ``len(token_ids)``); None when its adapter's path is unknown."""
        keys = self.keys(token_ids, lora, cache_salt)
        if keys is None:
            return None
        blocks = self.match(keys, (endpoint,)).get(endpoint, 0)
        if pending is not None:
            blocks = max(blocks, pending.leading(keys, endpoint))
        return min(blocks * self.block_size, len(token_ids))

    def stats(self) -> IndexStats:
        table = self.table
        return IndexStats(
            keys=len(table),
            entries=table.entries(),
            endpoints=len(table.endpoints()),
            memory_bytes=table.memory_bytes(),
            events=self.events,
            ignored_events=self.ignored_events,
            evictions=table.evictions,
        )

    def memory_bytes(self) -> int:
        return self.table.memory_bytes()
