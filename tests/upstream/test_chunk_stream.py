"""Reading an upstream SSE stream (:class:`~pd_orchestrator.upstream.client.ChunkStream`):
the common one-line event read in place, every other event shape as the SSE format
has it, and each malformed chunk one clear error of the endpoint."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, cast

import orjson
import pytest

from pd_orchestrator.model.endpoints import Endpoint, Role
from pd_orchestrator.upstream.client import ChunkStream, Phase
from pd_orchestrator.upstream.errors import UpstreamProtocolError, UpstreamStatusError

pytestmark = pytest.mark.anyio

DECODER = Endpoint("d0", "http://127.0.0.1:1", Role.DECODE, "h200")


class _Pieces:
    """An answer's body as the network hands it over: ``pieces``, in order."""

    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = pieces
        self.closed = False

    async def _each(self) -> AsyncIterator[bytes]:
        for piece in self.pieces:
            yield piece

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._each()

    async def aclose(self) -> None:
        self.closed = True


async def _read(pieces: list[bytes], max_line: int = 1 << 20) -> list[list[Any]]:
    """The batches a stream of ``pieces`` yields."""
    stream = ChunkStream(cast(Any, _Pieces(pieces)), DECODER, Phase.DECODE, max_line)
    return [batch async for batch in stream]


def _event(chunk: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(chunk) + b"\n\n"


CHUNK = {"id": "c", "choices": [{"index": 0, "text": "a", "finish_reason": None}]}
LAST = {"id": "c", "choices": [{"index": 0, "text": "b", "finish_reason": "length"}]}


async def test_the_common_events_are_read_in_order_each_read_one_batch() -> None:
    batches = await _read([_event(CHUNK) + _event(CHUNK), _event(LAST) + b"data: [DONE]\n\n"])
    assert batches == [[CHUNK, CHUNK], [LAST]]


async def test_every_other_event_shape_reads_as_the_sse_format_has_it() -> None:
    text = orjson.dumps(CHUNK)
    pieces = [
        b": a comment, no data\n\n",  # skipped
        b"event: message\ndata: " + text + b"\n\n",  # another field beside the data
        b"data:" + text + b"\r\n\r",  # no space after the colon; CRLF cut after its CR
        b"\ndata: " + text[:10] + b"\ndata: " + text[10:] + b"\n\n",  # two data lines
        b"data: [DONE]\n\n",
    ]
    batches = await _read(pieces)
    assert [chunk for batch in batches for chunk in batch] == [CHUNK, CHUNK, CHUNK]
    split = orjson.loads(text[:10] + b"\n" + text[10:])  # two lines join with a newline
    assert split == CHUNK


async def test_a_last_event_without_a_blank_line_still_counts() -> None:
    assert await _read([_event(CHUNK), b"data: [DONE]"]) == [[CHUNK]]


@pytest.mark.parametrize(
    ("payload", "words"),
    [
        (b"{not json", "invalid JSON chunk"),
        (b"[1, 2]", "chunk is not an object"),
        (b'"text"', "chunk is not an object"),
    ],
)
async def test_a_malformed_chunk_is_a_protocol_error_of_the_endpoint(
    payload: bytes, words: str
) -> None:
    with pytest.raises(UpstreamProtocolError) as raised:
        await _read([_event(CHUNK) + b"data: " + payload + b"\n\n"])
    assert raised.value.endpoint == "d0" and words in str(raised.value)


async def test_an_error_chunk_is_the_upstream_s_status() -> None:
    error = {"object": "error", "message": "out of KV blocks", "code": 503}
    with pytest.raises(UpstreamStatusError) as raised:
        await _read([_event(CHUNK), _event(error)])
    assert raised.value.status == 503 and "out of KV blocks" in str(raised.value)
    nested = {"error": {"message": "bad request", "code": 400}}
    with pytest.raises(UpstreamStatusError) as raised:
        await _read([_event(nested)])
    assert raised.value.status == 400
    odd_code = {"error": {"message": "broken", "code": "x"}}
    with pytest.raises(UpstreamStatusError) as raised:
        await _read([_event(odd_code)])
    assert raised.value.status == 500


async def test_a_chunk_that_names_an_error_without_a_message_is_relayed() -> None:
    chunk = {**CHUNK, "error": None}
    assert await _read([_event(chunk), b"data: [DONE]\n\n"]) == [[chunk]]


async def test_a_stream_that_ends_without_done_or_with_a_long_event_is_a_protocol_error() -> None:
    with pytest.raises(UpstreamProtocolError, match="without \\[DONE\\]"):
        await _read([_event(CHUNK)])
    with pytest.raises(UpstreamProtocolError, match="exceeds 64 bytes"):
        await _read([b"data: " + b"x" * 100], max_line=64)
