"""Prefix affinity after Ray Serve's ``PrefixCacheAffinityRouter`` (pure).

:class:`PrefixTree` is a character-level radix tree shared by tenants (endpoints):
each node holds an edge of text and, per tenant that routed a prompt through it,
the time of its last use. It answers the longest prefix of a text that any of a
set of tenants has seen (:meth:`PrefixTree.prefix_match`), the tenants that hold
the fewest characters (:meth:`PrefixTree.smallest_tenants`), and evicts a tenant's
least recently used nodes (leaves first) when it holds more than
``eviction_threshold_chars`` until it holds at most ``eviction_target_chars``.

:func:`affinity_choice` is the routing decision:

1. queue depths spread by more than ``imbalanced_threshold`` -> power of two
   choices over all candidates;
2. else the longest prefix match among the candidates: a match rate (matched
   characters / prompt characters) of at least ``match_rate_threshold`` prefers the
   tenants with that match; a lower rate prefers the tenants holding the fewest
   characters (the least used caches);
3. power of two choices among the preferred candidates (all, when none).

Power of two choices draws two distinct candidates from a seeded hash of the
request's sequence number and takes the one with the shorter queue.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Collection, Sequence

from pd_orchestrator.model.records import record

__all__ = ["AffinityParams", "PrefixTree", "affinity_choice", "power_of_two"]


class _Node:
    __slots__ = ("children", "end", "parent", "tenants", "text")

    def __init__(self, text: str, parent: _Node | None, end: int) -> None:
        self.text = text
        self.parent = parent
        self.end = end  # characters from the root to the end of this node's edge
        self.children: dict[str, _Node] = {}
        self.tenants: dict[str, float] = {}


def _common_length(text: str, pos: int, edge: str) -> int:
    """Length of the common prefix of ``text[pos:]`` and ``edge``."""
    if text.startswith(edge, pos):
        return len(edge)
    low, high = 0, min(len(edge), len(text) - pos)
    while low < high:  # largest n with text[pos:pos+n] == edge[:n]
        mid = (low + high + 1) // 2
        if text[pos : pos + mid] == edge[:mid]:
            low = mid
        else:
            high = mid - 1
    return low


class PrefixTree:
    """A multi-tenant character radix tree; see the module docstring."""

    def __init__(self) -> None:
        self.root = _Node("", None, 0)
        self._chars: dict[str, int] = {}
        self._nodes: dict[str, set[_Node]] = {}

    def chars(self, tenant: str) -> int:
        """Characters ``tenant`` holds (the sum of the edges it routed through)."""
        return self._chars.get(tenant, 0)

    def tenants(self) -> list[str]:
        return list(self._chars)

    def insert(self, text: str, tenant: str, now: float) -> None:
        """``tenant`` served ``text`` at ``now``: mark the whole path as used by it."""
        node, pos = self.root, 0
        self._touch(node, tenant, now)
        while pos < len(text):
            child = node.children.get(text[pos])
            if child is None:
                child = _Node(text[pos:], node, len(text))
                node.children[text[pos]] = child
                self._touch(child, tenant, now)
                return
            length = _common_length(text, pos, child.text)
            if length < len(child.text):
                child = self._split(child, length)
            self._touch(child, tenant, now)
            node, pos = child, pos + length

    def prefix_match(self, text: str, tenants: Collection[str]) -> tuple[int, list[str]]:
        """The longest prefix of ``text`` one of ``tenants`` routed: its length in
        characters and the tenants (of ``tenants``) that routed it ((0, []) if none)."""
        node, pos, matched = self.root, 0, []
        while pos < len(text):
            child = node.children.get(text[pos])
            if child is None:
                break
            live = [t for t in child.tenants if t in tenants]
            if not live:
                break
            length = _common_length(text, pos, child.text)
            pos, matched = pos + length, live
            if length < len(child.text):
                break
            node = child
        return (pos, matched) if matched else (0, [])

    def smallest_tenants(self, tenants: Collection[str]) -> list[str]:
        """Those of ``tenants`` holding the fewest characters (unknown ones hold 0)."""
        if not tenants:
            return []
        fewest = min(self.chars(t) for t in tenants)
        return [t for t in tenants if self.chars(t) == fewest]

    def evict(self, tenant: str, target_chars: int) -> int:
        """Drop ``tenant``'s least recently used nodes (leaves first) until it holds at
        most ``target_chars``; returns the characters dropped."""
        before = self.chars(tenant)
        if before <= target_chars:
            return 0
        order = sorted(self._nodes[tenant], key=lambda n: (n.tenants[tenant], -n.end))
        for node in order:
            if self.chars(tenant) <= target_chars:
                break
            if node is not self.root:
                self._untouch(node, tenant)
        return before - self.chars(tenant)

    def remove_tenant(self, tenant: str) -> None:
        """Forget ``tenant`` entirely (its endpoint left the fleet)."""
        for node in sorted(self._nodes.get(tenant, ()), key=lambda n: -n.end):
            self._untouch(node, tenant)
        self._chars.pop(tenant, None)
        self._nodes.pop(tenant, None)

    def _touch(self, node: _Node, tenant: str, now: float) -> None:
        if tenant not in node.tenants:
            self._chars[tenant] = self._chars.get(tenant, 0) + len(node.text)
            self._nodes.setdefault(tenant, set()).add(node)
        node.tenants[tenant] = now

    def _untouch(self, node: _Node, tenant: str) -> None:
        del node.tenants[tenant]
        self._chars[tenant] -= len(node.text)
        self._nodes[tenant].discard(node)
        if not node.tenants and node.parent is not None and not node.children:
            del node.parent.children[node.text[0]]
            node.parent = None

    def _split(self, child: _Node, length: int) -> _Node:
        """Cut ``child``'s edge after ``length`` characters; return the new upper node."""
        parent = child.parent
        assert parent is not None
        upper = _Node(child.text[:length], parent, child.end - len(child.text) + length)
        upper.tenants = dict(child.tenants)
        for tenant in upper.tenants:
            self._nodes[tenant].add(upper)
        parent.children[upper.text[0]] = upper
        child.text = child.text[length:]
        child.parent = upper
        upper.children[child.text[0]] = child
        return upper

    def memory_bytes(self) -> int:
        """Bytes of the nodes, their texts and their dicts (walks the whole tree)."""
        total, stack = 0, [self.root]
        while stack:
            node = stack.pop()
            total += sys.getsizeof(node) + sys.getsizeof(node.text)
            total += sys.getsizeof(node.children) + sys.getsizeof(node.tenants)
            stack.extend(node.children.values())
        total += sum(sys.getsizeof(nodes) for nodes in self._nodes.values())
        return total


@record
class AffinityParams:
    """Ray Serve's knobs: queue spread that counts as imbalanced (10) and the
    minimum match rate (0.1)."""

    imbalanced_threshold: int = 10
    match_rate_threshold: float = 0.1


def _draw(seed: str, sequence: int, salt: str) -> int:
    digest = hashlib.blake2b(f"{seed}\x00{sequence}\x00{salt}".encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "big")


def power_of_two(depths: Sequence[int], allowed: Sequence[int], seed: str, sequence: int) -> int:
    """Of two distinct indices of ``allowed`` drawn from ``seed`` and ``sequence``, the
    one with the smaller ``depths`` value (the first drawn on a tie)."""
    if len(allowed) == 1:
        return allowed[0]
    first = _draw(seed, sequence, "a") % len(allowed)
    second = _draw(seed, sequence, "b") % (len(allowed) - 1)
    second += second >= first
    a, b = allowed[first], allowed[second]
    return b if depths[b] < depths[a] else a


def affinity_choice(
    tree: PrefixTree,
    text: str,
    names: Sequence[str],
    depths: Sequence[int],
    params: AffinityParams,
    *,
    seed: str = "0",
    sequence: int = 0,
    blocked: Sequence[bool] | None = None,
) -> int:
    """The index in ``names`` of the chosen candidate; see the module docstring.

    ``depths`` are the candidates' queue depths, in the order of ``names``.
    Candidates ``blocked`` (over their share of traffic) are never preferred for
    their prefix; they remain in the power-of-two fallbacks.
    """
    everyone = list(range(len(names)))
    if max(depths) - min(depths) > params.imbalanced_threshold or not text:
        return power_of_two(depths, everyone, seed, sequence)
    open_names = [n for i, n in enumerate(names) if not (blocked and blocked[i])]
    matched, tenants = tree.prefix_match(text, set(open_names))
    if matched / len(text) >= params.match_rate_threshold and tenants:
        preferred = set(tenants)
    else:
        preferred = set(tree.smallest_tenants(open_names))
    allowed = [i for i in everyone if names[i] in preferred] or everyone
    return power_of_two(depths, allowed, seed, sequence)
