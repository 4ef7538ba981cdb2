"""Prompt digests: a prompt known by its block hashes instead of its tokens.

An engine normally hashes every full block of a prompt and folds every prompt token
into the request's generation state. A fleet simulator replaying thousands of
prompts of many thousand tokens spends most of its time there, so a request may
carry a :class:`PromptDigest` instead (an opt-in fast path): the chained hashes of
the prompt's full blocks at the engine's block size, the tokens after the last full
block, and the generation state after the whole prompt.

The engine trusts a digest. Two digests share the KV of their leading blocks
exactly when their leading hashes are equal, so a digest built by any scheme that
gives equal prefixes equal hashes (and different prefixes different ones) behaves
like the prompt it stands for. :meth:`PromptDigest.of_tokens` builds the digest the
engine itself would compute for a token list (requests then behave identically
either way); :meth:`PromptDigest.extend` appends tokens the way the engine extends
a request's hashes while it generates, so a continuation (prompt + generated
tokens) matches the blocks its first run cached.
"""

from __future__ import annotations

from collections.abc import Sequence

from pd_orchestrator.model.records import record
from pd_orchestrator.prefix.hashing import BlockExtras
from pd_orchestrator.sim.blocks import BlockHasher
from pd_orchestrator.sim.generation import advance_all

__all__ = ["PromptDigest"]


@record
class PromptDigest:
    """``num_tokens`` prompt tokens as ``block_hashes`` (full blocks), ``tail`` (the
    tokens after them, fewer than a block) and the generation ``state`` after them."""

    num_tokens: int
    block_hashes: tuple[bytes, ...]
    tail: tuple[int, ...]
    state: int

    @property
    def offset(self) -> int:
        """Position of the first tail token (the tokens covered by the hashes)."""
        return self.num_tokens - len(self.tail)

    def check(self, block_size: int) -> None:
        """``ValueError`` unless the digest is consistent for ``block_size``."""
        covered = len(self.block_hashes) * block_size
        if covered + len(self.tail) != self.num_tokens or len(self.tail) >= block_size:
            raise ValueError(
                f"digest of {self.num_tokens} tokens with {len(self.block_hashes)} block "
                f"hashes and {len(self.tail)} tail tokens does not fit block size {block_size}"
            )

    @classmethod
    def of_tokens(
        cls,
        tokens: Sequence[int],
        hasher: BlockHasher,
        root_state: int,
        extras: BlockExtras | None = None,
    ) -> PromptDigest:
        """The digest an engine with ``hasher`` and ``root_state`` computes for ``tokens``."""
        hashes = hasher.extend([], tokens, extras)
        covered = len(hashes) * hasher.block_size
        return cls(
            len(tokens), tuple(hashes), tuple(tokens[covered:]), advance_all(root_state, tokens)
        )

    def extend(
        self,
        tokens: Sequence[int],
        hasher: BlockHasher,
        extras: BlockExtras | None = None,
    ) -> PromptDigest:
        """The digest of this prompt followed by ``tokens`` (hashed as the engine does)."""
        rest = [*self.tail, *tokens]
        hashes = hasher.extend(list(self.block_hashes), rest, extras, offset=self.offset)
        total = self.num_tokens + len(tokens)
        covered = len(hashes) * hasher.block_size
        return PromptDigest(
            total,
            tuple(hashes),
            tuple(rest[covered - self.offset :]),
            advance_all(self.state, tokens),
        )
