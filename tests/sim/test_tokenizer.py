from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pd_orchestrator.sim.tokenizer import (
    EOS_TOKEN_ID,
    NUM_WORDS,
    VOCAB_SIZE,
    WORD_BASE,
    SimTokenizer,
    word_for_id,
)

tok = SimTokenizer()


@given(st.text())
def test_decode_inverts_encode(text: str) -> None:
    assert tok.decode(tok.encode(text)) == text


def test_words_are_single_tokens_and_bytes_cover_the_rest() -> None:
    word = word_for_id(WORD_BASE + 1234)
    assert tok.encode(word) == [WORD_BASE + 1234]
    assert tok.encode("Zé") == list("Zé".encode())


def test_word_texts_are_unique() -> None:
    texts = {word_for_id(WORD_BASE + i) for i in range(NUM_WORDS)}
    assert len(texts) == NUM_WORDS


def test_generated_words_retokenize_to_the_same_ids() -> None:
    ids = [WORD_BASE + i for i in (0, 7, 4899, 4900, NUM_WORDS - 1)]
    assert tok.encode(tok.decode(ids)) == ids


def test_eos_decodes_to_nothing() -> None:
    assert tok.decode([EOS_TOKEN_ID]) == ""


def test_validate_names_the_bad_id() -> None:
    with pytest.raises(ValueError, match=str(VOCAB_SIZE)):
        tok.validate([1, VOCAB_SIZE])
