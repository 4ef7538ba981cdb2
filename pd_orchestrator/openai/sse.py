"""Server-sent events as OpenAI streams use them: ``data: <json>`` lines and ``[DONE]``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import orjson

__all__ = ["DONE", "encode_event", "iter_sse_data"]

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
