"""vLLM's prefix-cache block hashing, reproduced bit for bit (pure).

vLLM (v1, 0.32) keys each *full* block of ``block_size`` tokens by a chained hash::

    hash_i = H((hash_{i-1} or NONE_HASH, tuple(tokens of block i), extra_keys_i))
    NONE_HASH = H(seed)

``H`` is the ``--prefix-caching-hash-algo``: ``sha256`` (the default: SHA-256 of the
pickled object, highest pickle protocol) or ``sha256_cbor`` (SHA-256 of canonical
CBOR). ``seed`` is ``PYTHONHASHSEED`` when set; otherwise, for these cryptographic
algorithms, the fixed string ``"vllm-none-hash"`` (the ``xxhash`` variants draw a
random per-process seed unless ``PYTHONHASHSEED`` is set, and are not supported here).

``extra_keys_i`` is ``None`` or a tuple of tagged keys, in this order: the LoRA
adapter ``("lora", name, path)`` on every block, then ``("cache_salt", salt)`` on
the first block only (multi-modal and prompt-embedding keys are out of scope).

KV events carry a hash either as those digest bytes or, by default
(``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``), as the digest's last 8 bytes read as a
big-endian unsigned integer; :func:`external_hash` maps both forms to that integer,
the key the prefix indexes use.
"""

from __future__ import annotations

import hashlib
import pickle
import struct
from collections.abc import Callable, Sequence
from typing import Any, get_args

from pd_orchestrator.model.hashing import HashAlgo
from pd_orchestrator.model.records import record

__all__ = [
    "DEFAULT_NONE_HASH_SEED",
    "HASH_ALGOS",
    "BlockExtras",
    "LoraKey",
    "VllmBlockHasher",
    "cbor_dumps",
    "external_hash",
    "hash_function",
    "resolve_seed",
]

HASH_ALGOS: tuple[str, ...] = get_args(HashAlgo)
DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
_U64 = (1 << 64) - 1


def resolve_seed(python_hash_seed: str | None) -> str:
    """The seed of ``NONE_HASH``: ``PYTHONHASHSEED`` when set, else vLLM's fixed default."""
    return DEFAULT_NONE_HASH_SEED if python_hash_seed is None else python_hash_seed


def _sha256_pickle(obj: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def _sha256_cbor(obj: Any) -> bytes:
    return hashlib.sha256(cbor_dumps(obj)).digest()


def hash_function(algo: HashAlgo) -> Callable[[Any], bytes]:
    """The digest function of ``algo``; ``ValueError`` for an unsupported name."""
    if algo == "sha256":
        return _sha256_pickle
    if algo == "sha256_cbor":
        return _sha256_cbor
    raise ValueError(f"unsupported prefix-caching hash algorithm {algo!r} (use {HASH_ALGOS})")


def _cbor_head(major: int, value: int) -> bytes:
    if value < 24:
        return bytes([major << 5 | value])
    for info, fmt in ((24, ">B"), (25, ">H"), (26, ">I"), (27, ">Q")):
        if value < 1 << (8 * struct.calcsize(fmt)):
            return bytes([major << 5 | info]) + struct.pack(fmt, value)
    raise ValueError(f"{value} does not fit a CBOR head")


def cbor_dumps(obj: Any) -> bytes:
    """Canonical CBOR (RFC 8949) of None, bools, 64-bit ints, bytes, str, tuples and
    lists: the subset a block-hash input uses. ``TypeError`` for anything else."""
    out = bytearray()
    _cbor_into(out, obj)
    return bytes(out)


def _cbor_into(out: bytearray, obj: Any) -> None:
    if obj is None:
        out.append(0xF6)
    elif isinstance(obj, bool):
        out.append(0xF5 if obj else 0xF4)
    elif isinstance(obj, int):
        out += _cbor_head(0, obj) if obj >= 0 else _cbor_head(1, -1 - obj)
    elif isinstance(obj, bytes):
        out += _cbor_head(2, len(obj)) + obj
    elif isinstance(obj, str):
        data = obj.encode("utf-8")
        out += _cbor_head(3, len(data)) + data
    elif isinstance(obj, tuple | list):
        out += _cbor_head(4, len(obj))
        for item in obj:
            _cbor_into(out, item)
    else:
        raise TypeError(f"cannot CBOR-encode {type(obj).__name__}")


def external_hash(block_hash: bytes | int) -> int:
    """The 64-bit key of a block hash: an int as is (masked to 64 bits), bytes by
    their last 8 bytes read big-endian (shorter ones zero-padded on the left)."""
    if isinstance(block_hash, int):
        return block_hash & _U64
    return int.from_bytes(block_hash[-8:], "big")


@record
class LoraKey:
    """A LoRA adapter as vLLM keys it: the name and the path it was loaded from."""

    name: str
    path: str


@record
class BlockExtras:
    """What besides tokens separates prefix caches: a LoRA adapter and a cache salt."""

    lora: LoraKey | None = None
    cache_salt: str | None = None

    def keys(self, block_index: int) -> tuple[tuple[str, ...], ...] | None:
        """The ``extra_keys`` of block ``block_index`` (None when there are none)."""
        keys: list[tuple[str, ...]] = []
        if self.lora is not None:
            keys.append(("lora", self.lora.name, self.lora.path))
        if block_index == 0 and self.cache_salt:
            keys.append(("cache_salt", self.cache_salt))
        return tuple(keys) if keys else None


class VllmBlockHasher:
    """Chained block hashes as a vLLM server with the same settings computes them.

    ``seed`` is the resolved seed (see :func:`resolve_seed`). Hashes are digest
    bytes; :func:`external_hash` turns one into the key KV events use.
    """

    def __init__(self, block_size: int, algo: HashAlgo = "sha256", seed: str | None = None):
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        self.block_size = block_size
        self.algo = algo
        self.seed = resolve_seed(seed)
        self._hash = hash_function(algo)
        self.none_hash = self._hash(self.seed)

    def hash_block(
        self, parent: bytes | None, tokens: Sequence[int], extra_keys: tuple[Any, ...] | None
    ) -> bytes:
        """The hash of one full block after the block whose hash is ``parent``."""
        return self._hash((parent or self.none_hash, tuple(tokens), extra_keys))

    def extend(
        self,
        hashes: list[bytes],
        tokens: Sequence[int],
        extras: BlockExtras | None = None,
        offset: int = 0,
    ) -> list[bytes]:
        """Append to ``hashes`` (the hashes of the first ``len(hashes)`` blocks of the
        sequence) the hashes of its remaining full blocks; returns ``hashes``.

        ``tokens[i]`` is the token at position ``offset + i`` of the sequence;
        ``offset`` (a multiple of the block size, at most ``len(hashes) * block_size``)
        lets a caller keep only the tokens after the blocks it already hashed.
        """
        size = self.block_size
        if offset % size or offset > len(hashes) * size:
            raise ValueError(f"offset {offset} is not a hashed block boundary")
        for index in range(len(hashes), (offset + len(tokens)) // size):
            keys = extras.keys(index) if extras is not None else None
            parent = hashes[-1] if hashes else None
            start = index * size - offset
            hashes.append(self.hash_block(parent, tokens[start : start + size], keys))
        return hashes

    def block_hashes(
        self,
        tokens: Sequence[int],
        extras: BlockExtras | None = None,
        max_blocks: int | None = None,
    ) -> list[bytes]:
        """Hashes of the full blocks of ``tokens`` (at most ``max_blocks`` of them)."""
        if max_blocks is not None:
            tokens = tokens[: max_blocks * self.block_size]
        return self.extend([], tokens, extras)

    def keys(
        self,
        tokens: Sequence[int],
        extras: BlockExtras | None = None,
        max_blocks: int | None = None,
    ) -> list[int]:
        """The 64-bit keys (:func:`external_hash`) of :meth:`block_hashes`."""
        return [external_hash(h) for h in self.block_hashes(tokens, extras, max_blocks)]
