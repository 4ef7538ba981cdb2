"""Shared KV stores for the simulator: vLLM's ExampleConnector and LMCache.

The example connector saves the KV of every prompt it computes under a key derived
from the prompt's tokens, and a later request whose prompt has the same key loads
it all: matching is all-or-nothing on the prompt, not per prefix. The key is the
chained hash of the prompt's last full block before its final token, so the
loadable length is ``((n - 1) // block_size) * block_size`` tokens.

LMCache (:class:`LMCacheStore`) saves the KV in chunks of ``chunk_size`` tokens
(256 by default), each keyed by the token prefix it ends (the chained hash of its
last block), and a lookup loads the longest run of stored chunks from the start of
the prompt: a prefix match, chunk by chunk.

Keys live in a :class:`KeySet`: a plain ``set`` for a fleet simulated in one
process, or :class:`DirectoryKeys` (one marker file per key) for simulator
processes sharing a directory.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from pd_orchestrator.sim.engine import EngineRequest

__all__ = ["DirectoryKeys", "KeySet", "LMCacheStore", "SharedKVStore", "prompt_key"]


class KeySet(Protocol):
    def __contains__(self, key: object, /) -> bool: ...

    def add(self, key: str, /) -> None: ...


class DirectoryKeys:
    """Keys as empty files in a directory; safe for concurrent writers."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and (self.directory / f"{key}.kv").exists()

    def add(self, key: str) -> None:
        path = self.directory / f"{key}.kv"
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.touch()
        tmp.replace(path)


def prompt_key(
    num_prompt_tokens: int, block_hashes: Sequence[bytes], block_size: int
) -> str | None:
    """The storage key of a prompt, or None when it has no full block to store."""
    blocks = max(0, num_prompt_tokens - 1) // block_size
    if blocks == 0 or len(block_hashes) < blocks:
        return None
    return block_hashes[blocks - 1].hex()


class SharedKVStore:
    """The engine's :class:`~pd_orchestrator.sim.engine.ExternalKV` for shared storage."""

    def __init__(self, keys: KeySet, block_size: int) -> None:
        self.keys = keys
        self.block_size = block_size

    def loadable_tokens(self, request: EngineRequest, block_hashes: Sequence[bytes]) -> int:
        """Tokens loadable for ``request``: its whole aligned prompt, or nothing."""
        size = request.num_prompt_tokens
        key = prompt_key(size, block_hashes, self.block_size)
        if key is None or key not in self.keys:
            return 0
        return (max(0, size - 1) // self.block_size) * self.block_size

    def save(self, request: EngineRequest, block_hashes: Sequence[bytes]) -> None:
        """Store the KV of ``request``'s prompt (a marker under its key)."""
        key = prompt_key(request.num_prompt_tokens, block_hashes, self.block_size)
        if key is not None:
            self.keys.add(key)


class LMCacheStore:
    """The engine's :class:`~pd_orchestrator.sim.engine.ExternalKV` for LMCache."""

    def __init__(self, keys: KeySet, block_size: int, chunk_size: int) -> None:
        if chunk_size < block_size or chunk_size % block_size:
            raise ValueError("the LMCache chunk size must be a multiple of the block size")
        self.keys = keys
        self.block_size = block_size
        self.chunk_size = chunk_size
        self._blocks_per_chunk = chunk_size // block_size

    def _chunk_keys(self, block_hashes: Sequence[bytes]) -> list[str]:
        per = self._blocks_per_chunk
        return [
            f"lmc-{block_hashes[end - 1].hex()}" for end in range(per, len(block_hashes) + 1, per)
        ]

    def loadable_tokens(self, request: EngineRequest, block_hashes: Sequence[bytes]) -> int:
        """Tokens of the longest run of stored chunks from the start of the prompt."""
        prompt_blocks = request.num_prompt_tokens // self.block_size
        stored = 0
        for key in self._chunk_keys(block_hashes[:prompt_blocks]):
            if key not in self.keys:
                break
            stored += 1
        return stored * self.chunk_size

    def save(self, request: EngineRequest, block_hashes: Sequence[bytes]) -> None:
        """Store every full chunk of ``request``'s prompt."""
        for key in self._chunk_keys(block_hashes):
            self.keys.add(key)
