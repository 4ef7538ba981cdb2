"""The prefix hash algorithms vLLM offers (``--prefix-caching-hash-algo``), by name
(ground floor: the config validates against it, the hashers implement it)."""

from __future__ import annotations

from typing import Literal

__all__ = ["HashAlgo"]

HashAlgo = Literal["sha256", "sha256_cbor"]
