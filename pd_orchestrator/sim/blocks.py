"""Prefix-cached KV block pool, after vLLM's v1 ``BlockPool`` and the nanoGPT write-up.

* Only full blocks are cached. A block's key is vLLM's chained hash:
  ``hash(parent_hash or NONE_HASH, tuple(block_token_ids), extra_keys)``
  (:class:`BlockHasher`, bit-identical to vLLM's for the same settings).
* Lookup walks the chain from the first block and stops at the first miss.
* Free blocks (reference count 0) sit in an LRU queue, cached or not; allocation
  takes the head of the queue and, if that block was cached, evicts its hash.
  A lookup hit on a free cached block takes it out of the queue again.
* Freed blocks go to the tail of the queue in reverse order, so a request's last
  blocks are evicted before its first ones (its prefix stays reusable longest).

The pool records cache events (stored, removed, all cleared) in ``events`` for a
publisher to drain; it never does I/O itself.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from pd_orchestrator.model.hashing import HashAlgo
from pd_orchestrator.model.records import record
from pd_orchestrator.prefix.hashing import BlockExtras, VllmBlockHasher

__all__ = [
    "AllBlocksCleared",
    "BlockHasher",
    "BlockPool",
    "BlockRemoved",
    "BlockStored",
    "CacheEvent",
    "NoFreeBlocks",
]


class BlockHasher(VllmBlockHasher):
    """Chained block hashing identical to a vLLM server's for the same settings.

    ``hash_seed`` plays the part of ``PYTHONHASHSEED`` (None: unset, so vLLM's fixed
    seed); ``algo`` is ``--prefix-caching-hash-algo``. See
    :mod:`pd_orchestrator.prefix.hashing` for the algorithm.
    """

    def __init__(
        self, block_size: int, hash_seed: str | None = None, algo: HashAlgo = "sha256"
    ) -> None:
        super().__init__(block_size, algo, hash_seed)


@record
class BlockStored:
    """Blocks newly cached, in chain order; ``parent_block_hash`` precedes the first."""

    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    lora_name: str | None = None
    extra_keys: list[tuple[str, ...] | None] | None = None


@record
class BlockRemoved:
    """Cached blocks evicted."""

    block_hashes: list[bytes]


@record
class AllBlocksCleared:
    """The whole prefix cache was reset."""


CacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


def _event_extra_keys(
    extras: BlockExtras | None, start: int, stop: int
) -> list[tuple[str, ...] | None] | None:
    """vLLM's published (untagged) extra keys of blocks ``start..stop-1``: per block
    the LoRA name, then the cache salt (first block only); None when there are none."""
    if extras is None:
        return None
    per_block = [extras.keys(index) for index in range(start, stop)]
    if not any(per_block):
        return None
    return [None if keys is None else tuple(key[1] for key in keys) for keys in per_block]


class NoFreeBlocks(RuntimeError):
    """Raised by :meth:`BlockPool.allocate` when the pool cannot satisfy a request."""


@dataclass(slots=True)
class _Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None


@dataclass
class BlockPool:
    """``num_blocks`` KV blocks with a prefix cache and LRU eviction."""

    num_blocks: int
    block_size: int
    record_events: bool = False
    events: list[CacheEvent] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")
        self._blocks = [_Block(i) for i in range(self.num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(self.num_blocks))
        self._cached: dict[bytes, int] = {}

    # -- queries ---------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks with no reference (cached or not): what allocation can take."""
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by requests, like ``vllm:kv_cache_usage_perc``."""
        return 1.0 - len(self._free) / self.num_blocks

    @property
    def num_cached(self) -> int:
        """Blocks that currently carry a prefix-cache hash."""
        return len(self._cached)

    def is_cached(self, block_hash: bytes) -> bool:
        return block_hash in self._cached

    def is_free(self, block_id: int) -> bool:
        """Whether no request references ``block_id``."""
        return self._blocks[block_id].ref_cnt == 0

    def block_hash_of(self, block_id: int) -> bytes | None:
        return self._blocks[block_id].block_hash

    def longest_hit(self, hashes: Sequence[bytes], max_blocks: int) -> list[int]:
        """Block ids of the longest cached prefix of ``hashes`` (at most ``max_blocks``)."""
        hit: list[int] = []
        for block_hash in hashes[:max_blocks]:
            block_id = self._cached.get(block_hash)
            if block_id is None:
                break
            hit.append(block_id)
        return hit

    # -- mutations ---------------------------------------------------------------
    def touch(self, block_ids: Sequence[int]) -> None:
        """Take a reference on cached blocks found by :meth:`longest_hit`."""
        for block_id in block_ids:
            block = self._blocks[block_id]
            if block.ref_cnt == 0:
                del self._free[block_id]
            block.ref_cnt += 1

    def allocate(self, count: int) -> list[int]:
        """Take ``count`` blocks from the head of the free queue, evicting cached ones."""
        if count > len(self._free):
            raise NoFreeBlocks(f"need {count} blocks, {len(self._free)} free")
        taken: list[int] = []
        removed: list[bytes] = []
        for _ in range(count):
            block_id, _ = self._free.popitem(last=False)
            block = self._blocks[block_id]
            if block.block_hash is not None:
                del self._cached[block.block_hash]
                removed.append(block.block_hash)
                block.block_hash = None
            block.ref_cnt = 1
            taken.append(block_id)
        if removed and self.record_events:
            self.events.append(BlockRemoved(removed))
        return taken

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference on each block; unreferenced ones join the free queue."""
        for block_id in reversed(block_ids):
            block = self._blocks[block_id]
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block_id] = None

    def cache_blocks(
        self,
        block_ids: Sequence[int],
        hashes: Sequence[bytes],
        start: int,
        stop: int,
        token_ids: Sequence[int],
        extras: BlockExtras | None = None,
    ) -> None:
        """Register the full blocks ``start..stop-1`` of a request in the prefix cache.

        ``block_ids[i]`` holds the tokens ``token_ids[i*B:(i+1)*B]`` whose hash is
        ``hashes[i]`` (computed with ``extras``). A hash already cached by another
        block is left alone (the duplicate block stays uncached, as in vLLM).
        """
        run_start = start
        for index in range(start, stop + 1):
            if index < stop and self._register(block_ids[index], hashes[index]):
                continue
            if index > run_start and self.record_events:
                self._emit_stored(hashes, run_start, index, token_ids, extras)
            run_start = index + 1

    def _register(self, block_id: int, block_hash: bytes) -> bool:
        block = self._blocks[block_id]
        if block.block_hash is not None or block_hash in self._cached:
            return False
        block.block_hash = block_hash
        self._cached[block_hash] = block_id
        return True

    def _emit_stored(
        self,
        hashes: Sequence[bytes],
        start: int,
        stop: int,
        token_ids: Sequence[int],
        extras: BlockExtras | None,
    ) -> None:
        size = self.block_size
        lora = extras.lora if extras is not None else None
        self.events.append(
            BlockStored(
                block_hashes=list(hashes[start:stop]),
                parent_block_hash=hashes[start - 1] if start > 0 else None,
                token_ids=list(token_ids[start * size : stop * size]),
                block_size=size,
                lora_name=lora.name if lora is not None else None,
                extra_keys=_event_extra_keys(extras, start, stop),
            )
        )

    def reset(self) -> bool:
        """Drop every cached hash if no block is referenced; return whether it did."""
        if len(self._free) != self.num_blocks:
            return False
        for block in self._blocks:
            block.block_hash = None
        self._cached.clear()
        if self.record_events:
            self.events.append(AllBlocksCleared())
        return True
