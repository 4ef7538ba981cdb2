"""Blocks an endpoint is about to hold: the prompts in flight there (pure).

A precise index learns what an endpoint's KV cache holds from its KV events, which
come once a prefill has run. In a burst of prompts that share a prefix, the ones
queued behind the first are counted as uncached until that first prefill is done,
though the server will find their prefix cached when it reaches them: its scheduler
takes them in order, and the first one's blocks are stored by then. A
:class:`PendingBlocks` keeps, per endpoint, the block keys of the prompts the gateway
sent there that have had no first answer yet (held with the prompt's place in the
endpoint's backlog, given back with it), so a cached count can add them
(:meth:`PendingBlocks.leading`).

Keys are counted (a prompt sent twice holds its keys twice), so giving back one
prompt leaves the keys of another that shares its prefix. Memory is what the prompts
in flight hold: each at most the index's ``max_request_blocks`` keys.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from typing import Generic, TypeVar

__all__ = ["PendingBlocks"]

K = TypeVar("K", bound=Hashable)


class PendingBlocks(Generic[K]):
    """Per endpoint, the block keys of its prompts in flight; see the module docstring."""

    def __init__(self) -> None:
        self._held: dict[str, dict[K, int]] = {}

    def hold(self, endpoint: str, keys: Iterable[K]) -> None:
        """A prompt with ``keys`` was sent to ``endpoint``: they are pending there (pair
        with :meth:`release`)."""
        held = self._held.get(endpoint)
        if held is None:
            held = self._held[endpoint] = {}
        get = held.get
        for key in keys:
            held[key] = get(key, 0) + 1

    def release(self, endpoint: str, keys: Iterable[K]) -> None:
        """The prompt with ``keys`` on ``endpoint`` had its first answer, or ended: its
        keys are no longer pending there (a key no prompt holds is ignored)."""
        held = self._held.get(endpoint)
        if held is None:
            return
        for key in keys:
            count = held.get(key, 0)
            if count > 1:
                held[key] = count - 1
            elif count:
                del held[key]
        if not held:
            del self._held[endpoint]

    def leading(self, keys: Sequence[K], endpoint: str) -> int:
        """How many leading ``keys``, in a row, prompts in flight on ``endpoint`` hold."""
        held = self._held.get(endpoint)
        if not held:
            return 0
        count = 0
        for key in keys:
            if key not in held:
                break
            count += 1
        return count

    def keys(self, endpoint: str) -> int:
        """Distinct keys pending on ``endpoint``."""
        return len(self._held.get(endpoint, ()))
