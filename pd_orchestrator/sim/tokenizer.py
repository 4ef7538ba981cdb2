"""The simulator's deterministic tokenizer.

Vocabulary (``VOCAB_SIZE`` ids):

* ``0..255`` -- one token per UTF-8 byte (any text can be encoded);
* ``256`` -- ``EOS``, decoded as the empty string;
* ``257..`` -- ``NUM_WORDS`` pseudo-words, each a leading space followed by two
  to four consonant-vowel syllables derived from the id (``" kato"``, ``" mirelu"``).

Encoding splits text into runs of ``" "? + letters`` and single other characters;
a run that spells a vocabulary word becomes that word's id, anything else becomes
its UTF-8 bytes. ``decode(encode(text)) == text`` for every string, and every id
decodes on its own, so incremental (streamed) detokenization is exact as long as
generated ids are words -- which is all the simulator ever samples.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from functools import lru_cache

__all__ = [
    "EOS_TOKEN_ID",
    "NUM_WORDS",
    "VOCAB_SIZE",
    "WORD_BASE",
    "SimTokenizer",
    "word_for_id",
]

_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"
_SYLLABLES = tuple(c + v for c in _CONSONANTS for v in _VOWELS)  # 70 syllables
EOS_TOKEN_ID = 256
WORD_BASE = 257
NUM_WORDS = 32_000
VOCAB_SIZE = WORD_BASE + NUM_WORDS
_PIECE = re.compile(r" ?[a-z]+|.", re.DOTALL)


def word_for_id(token_id: int) -> str:
    """Return the text of word token ``token_id`` (``WORD_BASE <= id < VOCAB_SIZE``)."""
    index = token_id - WORD_BASE
    if not 0 <= index < NUM_WORDS:
        raise ValueError(f"{token_id} is not a word token")
    n = len(_SYLLABLES)
    # Two syllables always, a third and fourth as the index grows: unique per id.
    syllables = [_SYLLABLES[index % n], _SYLLABLES[(index // n) % n]]
    rest = index // (n * n)
    while rest:
        syllables.append(_SYLLABLES[rest % n])
        rest //= n
    return " " + "".join(syllables)


@lru_cache(maxsize=1)
def _word_table() -> dict[str, int]:
    return {word_for_id(WORD_BASE + i): WORD_BASE + i for i in range(NUM_WORDS)}


class SimTokenizer:
    """Deterministic, reversible tokenizer shared by the simulator and the tests."""

    eos_token_id = EOS_TOKEN_ID
    vocab_size = VOCAB_SIZE

    def encode(self, text: str) -> list[int]:
        """Encode ``text``; never fails and never adds special tokens."""
        words = _word_table()
        ids: list[int] = []
        for piece in _PIECE.findall(text):
            token = words.get(piece)
            if token is not None:
                ids.append(token)
            else:
                ids.extend(piece.encode("utf-8"))
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        """Decode ``ids``; byte runs are joined before UTF-8 decoding."""
        parts: list[str] = []
        pending = bytearray()
        for token in ids:
            if 0 <= token < 256:
                pending.append(token)
                continue
            if pending:
                parts.append(pending.decode("utf-8", errors="replace"))
                pending.clear()
            parts.append(self.token_text(token))
        if pending:
            parts.append(pending.decode("utf-8", errors="replace"))
        return "".join(parts)

    def token_text(self, token_id: int) -> str:
        """Text of one non-byte token (EOS decodes to the empty string)."""
        if token_id == EOS_TOKEN_ID:
            return ""
        if 0 <= token_id < 256:
            return bytes([token_id]).decode("utf-8", errors="replace")
        return word_for_id(token_id)

    def validate(self, ids: Sequence[int]) -> None:
        """Raise ``ValueError`` naming the first id outside the vocabulary."""
        for token in ids:
            if not 0 <= token < VOCAB_SIZE:
                raise ValueError(f"token id {token} is out of vocabulary (size {VOCAB_SIZE})")
