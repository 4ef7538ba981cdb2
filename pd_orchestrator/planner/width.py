"""Ask-all's adaptive width: which decoders to ask for one prompt (pure; no I/O).

Asking every decoder finds the one that holds a prompt's prefix, at the price of a
request (and a tokenization) on every decoder for every prompt, although most
prompts are held by one decoder or none. :class:`AdaptiveWidth` asks only the
decoders likely to admit:

* **Evidence.** A :class:`HolderIndex` remembers, per decoder, the leading blocks of
  the prompts it served (its prefix cache holds them: it admitted them, or took
  their KV from a prefiller, or prefilled them itself). A block is ``block_tokens``
  token ids when the prompt is known as ids, else ``chunk_chars`` characters; each
  block's key chains the keys before it, from a root that hashes the model, the
  LoRA adapter and the cache salt. With the precise prefix index (KV events), its
  match counts as evidence too, in its own blocks.
* **Likely holders.** A decoder is likely to admit when its remembered prefix covers
  the threshold's share of the prompt's blocks less one block (a block either way
  is the index's granularity). They are asked, best evidence first.
* **Threshold 0** (the policy says every decoder admits, or the request cannot be
  continued): one decoder, the ranking's first.
* **Unknown decoders** are asked whatever the evidence: a decoder the index has
  watched for less than ``warmup`` seconds (at start, or since it joined, or since
  it came back from failed health checks) may hold what this gateway never routed
  to it. A decoder whose load reading says it never looked a prompt up in its
  prefix cache (``prefix_queries`` 0: a fresh server) holds nothing and is known at
  once.
* **Restarts**: a decoder back from failed health checks, or whose
  ``prefix_queries`` counter went down (its server restarted, its cache is empty),
  is forgotten.
* **No likely holder**: nobody is asked; the request goes straight to P/D on the
  fallback decoder (``reason="cold"``). One such request in ``explore_every`` asks
  ``explore_width`` decoders instead (``explore``; the next ones at each turn, so
  every decoder takes its turn), which finds what the index cannot know: requests
  routed by another gateway replica, or by hand.

Staying correct when the index is wrong: the width only chooses whom to ask; every
asked decoder still applies the threshold to its real cache. An index that
over-estimates (a decoder evicted or lost the prefix) gets a rejection, then P/D,
and :meth:`AdaptiveWidth.rejected` drops the blocks the rejection proved missing;
one that under-estimates costs a prefill the decoder could have skipped, until
exploring or the next turn (recorded where it was served) fixes it.
"""

from __future__ import annotations

import hashlib
import math
from array import array
from collections.abc import Sequence

from pd_orchestrator.config.settings import AdaptiveWidthConfig
from pd_orchestrator.model.endpoints import Endpoint
from pd_orchestrator.model.load import Candidate
from pd_orchestrator.model.records import record
from pd_orchestrator.prefix.approximate import namespace
from pd_orchestrator.prefix.index import PreciseIndex
from pd_orchestrator.prefix.table import BlockTable
from pd_orchestrator.routing.types import RoutingRequest

__all__ = ["AdaptiveWidth", "Asked", "HolderIndex", "PromptKeys"]


def _chain(parent: bytes, data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=8, key=parent).digest()


@record
class PromptKeys:
    """A prompt's block keys (at most ``max_blocks``) and its whole length in blocks
    (0: too short for one block, or nothing to hash)."""

    keys: tuple[int, ...] = ()
    blocks: int = 0


class HolderIndex:
    """Per decoder, the block keys of the prompts it served (bounded, LRU per decoder)."""

    def __init__(self, config: AdaptiveWidthConfig) -> None:
        self.config = config
        self.table = BlockTable(config.capacity_per_endpoint)

    def keys(self, request: RoutingRequest) -> PromptKeys:
        """The chained block keys of ``request``'s prompt: token ids when it has them,
        else its text."""
        config = self.config
        parent = _chain(b"", namespace(request.model, request.lora, request.cache_salt).encode())
        if request.token_ids:
            ids = request.token_ids
            size, total = config.block_tokens, len(ids) // config.block_tokens
            count = min(total, config.max_blocks)
            data = [array("q", ids[i * size : (i + 1) * size]).tobytes() for i in range(count)]
        elif request.prompt:
            text = request.prompt
            size, total = config.chunk_chars, len(text) // config.chunk_chars
            count = min(total, config.max_blocks)
            data = [text[i * size : (i + 1) * size].encode() for i in range(count)]
        else:
            return PromptKeys()
        keys = []
        for block in data:
            parent = _chain(parent, block)
            keys.append(int.from_bytes(parent, "big"))
        return PromptKeys(tuple(keys), total)

    def held(self, keys: Sequence[int], decoders: Sequence[str]) -> dict[str, int]:
        """Leading ``keys`` each decoder holds in a row."""
        return self.table.prefix_lengths(keys, decoders)

    def record(self, keys: Sequence[int], decoder: str) -> None:
        self.table.add(decoder, keys)

    def drop(self, keys: Sequence[int], decoder: str) -> int:
        return self.table.remove(decoder, keys)

    def forget(self, decoder: str) -> int:
        return self.table.clear(decoder)

    def memory_bytes(self) -> int:
        return self.table.memory_bytes()


@record
class Asked:
    """The decoders to ask, best first, and why: ``no-threshold`` (one decoder),
    ``likely`` (the likely holders, with any unknown decoders), ``unknown`` (only
    unknown decoders), ``explore`` (``explore_width`` decoders), ``cold`` (none: straight to P/D)
    or ``short`` (a prompt shorter than one block: the ranking's first). ``keys``
    and ``blocks``: the prompt's block keys and length in blocks, for learning;
    ``partial``: the decoders seen holding at least one of its blocks, most first (the
    fallback prefers them among equals)."""

    decoders: tuple[Endpoint, ...]
    reason: str
    keys: tuple[int, ...] = ()
    blocks: int = 0
    partial: tuple[str, ...] = ()


def needed_blocks(threshold: float, blocks: int) -> int:
    """Leading blocks a decoder must be seen holding to be asked: the threshold's share
    of the prompt's blocks, less one block, and at least one."""
    return max(1, math.ceil(threshold * blocks) - 1)


class AdaptiveWidth:
    """Chooses the decoders an ask-all request asks; see the module docstring."""

    def __init__(self, config: AdaptiveWidthConfig, precise: PreciseIndex | None = None) -> None:
        self.config = config
        self.index = HolderIndex(config)
        self.precise = precise
        self._watched: dict[str, float] = {}  # decoder -> since when the index knows it
        self._down: set[str] = set()  # decoders seen out of routing by failed checks
        self._queried: dict[str, float] = {}  # decoder -> its last prefix_queries reading
        self._empty: set[str] = set()  # decoders seen with an empty cache since forgotten
        self.reasons: dict[str, int] = {}  # requests by Asked.reason
        self.asked_total = 0  # decoders asked, over every request

    def inherit(self, previous: AdaptiveWidth) -> None:
        """Keep what ``previous`` (the width of the configuration before a reload) knew,
        when it was configured alike."""
        if previous.config == self.config:
            self.index = previous.index
            self._watched = previous._watched
            self._down = previous._down
            self._queried = previous._queried
            self._empty = previous._empty
            self.reasons = previous.reasons
            self.asked_total = previous.asked_total

    def asked(
        self,
        request: RoutingRequest,
        decoders: tuple[Endpoint, ...],
        candidates: Sequence[Candidate],
        threshold: float,
    ) -> Asked:
        """The decoders to ask for ``request`` among ``decoders`` (the ranking, best
        first) with ``threshold``; ``candidates`` carry the fleet's health."""
        self._watch(candidates, request.now)
        asked = self._choose(request, decoders, threshold)
        self.reasons[asked.reason] = self.reasons.get(asked.reason, 0) + 1
        self.asked_total += len(asked.decoders)
        return asked

    def _choose(
        self, request: RoutingRequest, decoders: tuple[Endpoint, ...], threshold: float
    ) -> Asked:
        if threshold <= 0.0 or not decoders:
            return Asked(decoders[:1], "no-threshold")
        prompt = self.index.keys(request)
        if prompt.blocks == 0:
            return Asked(decoders[:1], "short")
        names = [d.name for d in decoders]
        need = needed_blocks(threshold, prompt.blocks)
        hashed = len(prompt.keys)  # fewer than its blocks past max_blocks: all held counts whole
        seen = self.index.held(prompt.keys, names)
        evidence = {n: 1.0 if held == hashed else held / prompt.blocks for n, held in seen.items()}
        for name, share in self._precise(request, names).items():
            evidence[name] = max(evidence[name], share)
        cutoff = need / prompt.blocks
        likely = sorted(
            (d for d in decoders if evidence[d.name] >= cutoff - 1e-9),
            key=lambda d: -evidence[d.name],
        )
        unknown = [d for d in decoders if self._unknown(d.name, request.now) and d not in likely]
        ranked = sorted(
            (n for n, share in evidence.items() if share > 0), key=lambda n: -evidence[n]
        )
        learned = (prompt.keys, prompt.blocks, tuple(ranked))
        if likely:
            return Asked((*likely, *unknown), "likely", *learned)
        if unknown:
            return Asked(tuple(unknown), "unknown", *learned)
        every = self.config.explore_every
        if every and request.sequence % every == 0:
            return Asked(self._explored(decoders, request.sequence // every), "explore", *learned)
        return Asked((), "cold", *learned)

    def _explored(self, decoders: tuple[Endpoint, ...], turn: int) -> tuple[Endpoint, ...]:
        """The ``explore_width`` decoders an exploring request asks (0: all), the next
        ones in the fleet's order at each turn, so that every decoder takes its turn."""
        width = self.config.explore_width
        if not width or width >= len(decoders):
            return decoders
        ordered = sorted(decoders, key=lambda d: d.name)
        start = turn * width % len(ordered)
        return tuple(ordered[(start + i) % len(ordered)] for i in range(width))

    def _precise(self, request: RoutingRequest, names: Sequence[str]) -> dict[str, float]:
        """Each decoder's share of the prompt's blocks in the precise index (KV events)."""
        index = self.precise
        if index is None or not request.token_ids:
            return {}
        keys = index.keys(request.token_ids, request.lora, request.cache_salt)
        total = len(request.token_ids) // index.block_size
        if not keys or total == 0:
            return {}
        return {name: held / total for name, held in index.match(keys, names).items()}

    def _watch(self, candidates: Sequence[Candidate], now: float) -> None:
        """Start watching decoders seen for the first time; forget what the index holds
        of a decoder back from failed health checks or restarted (see the module
        docstring); know at once a decoder whose cache never held anything."""
        watched, down = self._watched, self._down
        for candidate in candidates:
            name = candidate.endpoint.name
            if not candidate.endpoint.role.decodes:
                continue
            if name not in watched:
                watched[name] = now
            if not candidate.healthy:
                down.add(name)
            elif name in down:
                down.discard(name)
                self._forget(name, now)
            load = candidate.load
            if load is not None and load.prefix_queries is not None:
                self._read(name, load.prefix_queries, now)

    def _read(self, name: str, queried: float, now: float) -> None:
        """A decoder's ``prefix_queries`` reading: a drop is a restart; 0 an empty cache."""
        last = self._queried.get(name)
        self._queried[name] = queried
        if last is not None and queried < last:
            self._forget(name, now)
        if queried == 0:
            self._empty.add(name)

    def _forget(self, name: str, now: float) -> None:
        self.index.forget(name)
        self._watched[name] = now
        self._empty.discard(name)

    def _unknown(self, name: str, now: float) -> bool:
        if name in self._empty:
            return False
        since = self._watched.get(name)
        return since is None or now - since < self.config.warmup

    def served(self, keys: Sequence[int], decoder: str) -> None:
        """``decoder`` served a prompt with ``keys``: its cache holds them now."""
        if keys:
            self.index.record(keys, decoder)

    def rejected(self, keys: Sequence[int], decoder: str, threshold: float, blocks: int) -> int:
        """``decoder`` rejected a prompt with ``keys`` at ``threshold``: it holds fewer
        than the threshold's share of its ``blocks``, so the index's blocks from the
        threshold's less one are not all there; they are dropped (returns how many)."""
        if not keys or threshold <= 0.0:
            return 0
        start = needed_blocks(threshold, blocks) - 1
        return self.index.drop(keys[start:], decoder)

    def report(self, now: float) -> dict[str, object]:
        """For ``/status``: requests by reason, decoders asked per request, the decoders
        still warming up (asked whatever the evidence) and the index's size."""
        requests = sum(self.reasons.values())
        table = self.index.table
        return {
            "requests": requests,
            "asked_per_request": round(self.asked_total / requests, 3) if requests else None,
            "skipped": self.reasons.get("cold", 0),
            "by_reason": dict(sorted(self.reasons.items())),
            "warming_up": sorted(n for n in self._watched if self._unknown(n, now)),
            "index": {
                "entries": table.entries(),
                "keys": len(table),
                "memory_bytes": self.index.memory_bytes(),
            },
        }
