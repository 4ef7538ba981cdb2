"""Which endpoints hold which block keys (pure, bounded).

A :class:`BlockTable` maps a 64-bit block key to the set of endpoints holding it,
stored as a bitmask over small endpoint ids, and keeps per endpoint its keys in
least-recently-added order. With a ``capacity`` per endpoint, adding beyond it
evicts that endpoint's least recently added keys, so memory is bounded by
``capacity`` times the number of endpoints. :meth:`BlockTable.prefix_lengths`
answers the routing question: for a chain of keys, how many leading keys each
endpoint holds consecutively.

Memory: :meth:`BlockTable.memory_bytes` adds the sizes of the containers (exact,
``sys.getsizeof``) to an estimate of the integer objects: one key object per
(key, endpoint) entry (an upper bound: entries of one key may share the object)
and, beyond 8 endpoints, one mask object per key.
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence

__all__ = ["BlockTable"]

_INT_BYTES = sys.getsizeof(2**62)


def _bits(mask: int) -> Iterator[int]:
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


class BlockTable:
    """Block key -> endpoints, with per-endpoint LRU order and optional capacity."""

    def __init__(self, capacity: int | None = None) -> None:
        if capacity is not None and capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        self.evictions = 0
        self._holders: dict[int, int] = {}
        self._keys: dict[str, OrderedDict[int, None]] = {}
        self._ids: dict[str, int] = {}
        self._names: dict[int, str] = {}
        self._free_ids: list[int] = []

    # -- queries -------------------------------------------------------------------
    def __len__(self) -> int:
        """Distinct keys held by at least one endpoint."""
        return len(self._holders)

    def endpoints(self) -> list[str]:
        """Endpoints holding at least one key, in first-seen order."""
        return [name for name, keys in self._keys.items() if keys]

    def size(self, endpoint: str) -> int:
        """Keys ``endpoint`` holds."""
        return len(self._keys.get(endpoint, ()))

    def entries(self) -> int:
        """(key, endpoint) pairs: the sum of :meth:`size` over endpoints."""
        return sum(len(keys) for keys in self._keys.values())

    def holders(self, key: int) -> frozenset[str]:
        """Endpoints holding ``key``."""
        return frozenset(self._names[i] for i in _bits(self._holders.get(key, 0)))

    def holds(self, endpoint: str, key: int) -> bool:
        return key in self._keys.get(endpoint, ())

    def prefix_lengths(self, keys: Sequence[int], endpoints: Iterable[str]) -> dict[str, int]:
        """For each of ``endpoints``, how many leading ``keys`` it holds in a row."""
        result = dict.fromkeys(endpoints, 0)
        alive = 0
        for name in result:
            if name in self._ids:
                alive |= 1 << self._ids[name]
        for position, key in enumerate(keys):
            if not alive:
                return result
            held = self._holders.get(key, 0) & alive
            for bit in _bits(alive & ~held):
                result[self._names[bit]] = position
            alive = held
        for bit in _bits(alive):
            result[self._names[bit]] = len(keys)
        return result

    # -- updates -------------------------------------------------------------------
    def add(self, endpoint: str, keys: Iterable[int]) -> int:
        """Record that ``endpoint`` holds ``keys`` (each becomes its most recent);
        returns how many of its keys the capacity evicted."""
        bit = 1 << self._id(endpoint)
        held = self._keys[endpoint]
        holders = self._holders
        capacity = self.capacity
        evicted = 0
        for key in keys:
            if key in held:
                held.move_to_end(key)
                continue
            holders[key] = holders.get(key, 0) | bit
            held[key] = None
            if capacity is not None and len(held) > capacity:
                self._unhold(held.popitem(last=False)[0], bit)
                evicted += 1
        self.evictions += evicted
        return evicted

    def remove(self, endpoint: str, keys: Iterable[int]) -> int:
        """Forget that ``endpoint`` holds ``keys``; returns how many it held."""
        held = self._keys.get(endpoint)
        if not held:
            return 0
        bit = 1 << self._ids[endpoint]
        removed = 0
        for key in keys:
            if key in held:
                del held[key]
                self._unhold(key, bit)
                removed += 1
        return removed

    def clear(self, endpoint: str) -> int:
        """Forget every key of ``endpoint`` and free its id; returns how many it held."""
        held = self._keys.pop(endpoint, None)
        if held is None:
            return 0
        index = self._ids.pop(endpoint)
        del self._names[index]
        self._free_ids.append(index)
        bit = 1 << index
        for key in held:
            self._unhold(key, bit)
        return len(held)

    def _id(self, endpoint: str) -> int:
        index = self._ids.get(endpoint)
        if index is None:
            index = self._free_ids.pop() if self._free_ids else len(self._ids)
            self._ids[endpoint] = index
            self._names[index] = endpoint
            self._keys[endpoint] = OrderedDict()
        return index

    def _unhold(self, key: int, bit: int) -> None:
        mask = self._holders.get(key, 0) & ~bit
        if mask:
            self._holders[key] = mask
        else:
            self._holders.pop(key, None)

    # -- accounting ----------------------------------------------------------------
    def memory_bytes(self) -> int:
        """Estimated bytes held by the table (see the module docstring)."""
        total = sys.getsizeof(self._holders) + sys.getsizeof(self._keys)
        total += sum(sys.getsizeof(keys) for keys in self._keys.values())
        total += _INT_BYTES * self.entries()
        if len(self._names) > 8:  # masks of up to 8 endpoints are cached small ints
            total += _INT_BYTES * len(self._holders)
        return total
