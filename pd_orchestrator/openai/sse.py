"""Server-sent events as OpenAI streams use them: ``data: <json>`` lines and ``[DONE]``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import orjson

__all__ = ["DONE", "chunk_tokens", "encode_event", "iter_sse_data"]

DONE = b"data: [DONE]\n\n"


def encode_event(payload: dict[str, Any]) -> bytes:
    """One ``data:`` event carrying ``payload`` as compact JSON."""
    return b"data: " + orjson.dumps(payload) + b"\n\n"


async def iter_sse_data(lines: AsyncIterator[str]) -> AsyncIterator[str]:
    """Yield the ``data`` field of each event from an iterator of text lines.

    Multi-line data fields are joined with newlines; comments and other fields
    are skipped. The literal ``[DONE]`` is yielded like any other data.
    """
    buffer: list[str] = []
    async for line in lines:
        if line == "":
            if buffer:
                yield "\n".join(buffer)
                buffer = []
            continue
        if line.startswith(":"):
            continue
        field, _, value = line.partition(":")
        if field == "data":
            buffer.append(value[1:] if value.startswith(" ") else value)
    if buffer:
        yield "\n".join(buffer)


def chunk_tokens(chunk: dict[str, Any]) -> int:
    """The generated tokens a streamed completion chunk carries: the length of each
    choice's ``token_ids`` (``return_token_ids``), else 1 for a choice with text (a
    token may decode to no text of its own, as part of a multi-byte character, so
    without ids such a token is not seen)."""
    count = 0
    for choice in chunk.get("choices") or ():
        if not isinstance(choice, dict):
            continue
        ids = choice.get("token_ids")
        if isinstance(ids, list) and ids:
            count += len(ids)
        elif choice.get("text"):
            count += 1
    return count
