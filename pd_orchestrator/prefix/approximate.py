"""The approximate prefix cache: where each prompt prefix was routed (pure).

After the Gateway API inference extension's proposal: no tokenizer, no events. A
prompt is cut into chunks of ``chunk_chars`` characters (only full chunks count)
and each chunk gets a chained hash, ``h_i = H(h_{i-1}, chunk_i)``, whose root
``h_{-1}`` is a hash of the request's namespace (model, LoRA adapter, cache salt),
so different adapters and salts never share entries. When a request is routed to
an endpoint, every chunk key of its prompt is recorded as held by that endpoint
(:meth:`ApproximatePrefixCache.record`); a new request's keys are then matched
against the endpoints (:meth:`ApproximatePrefixCache.match`): how many leading
chunks each holds. Each endpoint keeps at most ``capacity_per_endpoint`` keys, the
least recently routed evicted first, which mimics the server's LRU cache.

Defaults: 64-character chunks and 31,250 chunks per endpoint (the proposal's
numbers: about 2M characters, ~500k tokens, per server); at most ``max_chunks``
(256) leading chunks of a prompt are hashed, which bounds the work per request.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

from pd_orchestrator.prefix.table import BlockTable

__all__ = ["ApproximatePrefixCache", "namespace"]


def namespace(model: str | None, lora: str | None, cache_salt: str | None) -> str:
    """The namespace of a request's prefix keys."""
    return "\x1f".join(part or "" for part in (model, lora, cache_salt))


def _hash64(parent: bytes, data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=8, key=parent).digest()


class ApproximatePrefixCache:
    """Chained character-chunk keys and where they were routed; see the module docstring."""

    def __init__(
        self, chunk_chars: int = 64, capacity_per_endpoint: int = 31_250, max_chunks: int = 256
    ) -> None:
        if chunk_chars < 1 or max_chunks < 1:
            raise ValueError("chunk_chars and max_chunks must be >= 1")
        self.chunk_chars = chunk_chars
        self.max_chunks = max_chunks
        self.table = BlockTable(capacity_per_endpoint)

    def keys(self, prompt: str, space: str = "") -> list[int]:
        """The chained keys of the full chunks of ``prompt`` (at most ``max_chunks``)."""
        size = self.chunk_chars
        count = min(len(prompt) // size, self.max_chunks)
        parent = _hash64(b"", space.encode())
        keys: list[int] = []
        for index in range(count):
            parent = _hash64(parent, prompt[index * size : (index + 1) * size].encode())
            keys.append(int.from_bytes(parent, "big"))
        return keys

    def match(self, keys: Sequence[int], endpoints: Iterable[str]) -> dict[str, int]:
        """Leading chunks of ``keys`` recorded on each endpoint, in a row."""
        return self.table.prefix_lengths(keys, endpoints)

    def record(self, keys: Sequence[int], endpoint: str) -> None:
        """``endpoint`` served a prompt with ``keys``: it now holds them (most recent)."""
        self.table.add(endpoint, keys)

    def forget(self, endpoint: str) -> int:
        """Drop everything recorded for ``endpoint``."""
        return self.table.clear(endpoint)

    def memory_bytes(self) -> int:
        return self.table.memory_bytes()
