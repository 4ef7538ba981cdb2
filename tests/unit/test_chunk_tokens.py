"""The generated tokens a streamed completion chunk carries
(:func:`pd_orchestrator.openai.sse.chunk_tokens`), which the start-up timing and the
profiler time a stream's steps by."""

from __future__ import annotations

from pd_orchestrator.openai.sse import chunk_tokens


def test_token_ids_count_each_token_and_text_counts_one_without_them() -> None:
    assert chunk_tokens({"choices": [{"text": "ab", "token_ids": [5, 6]}]}) == 2
    assert chunk_tokens({"choices": [{"text": "", "token_ids": [7]}]}) == 1  # no text of its own
    assert chunk_tokens({"choices": [{"text": "a"}]}) == 1


def test_a_chunk_with_no_token_counts_none() -> None:
    """The first chunk's empty ids (the prompt's ids ride beside them), the usage
    chunk, and choices that are not objects."""
    assert chunk_tokens({"choices": [{"text": "", "token_ids": []}]}) == 0
    assert chunk_tokens({"choices": [], "usage": {"completion_tokens": 32}}) == 0
    assert chunk_tokens({"choices": ["x", None]}) == 0
    assert chunk_tokens({}) == 0
