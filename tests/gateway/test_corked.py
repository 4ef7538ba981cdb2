"""The gateway's client connections write what one turn of the event loop produced
in one piece (:class:`~pd_orchestrator.gateway.protocol.CorkedTransport`)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from pd_orchestrator.gateway.protocol import CORK_BYTES, CorkedTransport

pytestmark = pytest.mark.anyio


class _Recording:
    """A transport that records its writes."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closing = False
        self.extra = {"peername": ("127.0.0.1", 1)}

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self.extra.get(name, default)

    def get_write_buffer_size(self) -> int:
        return 7


async def _corked() -> tuple[CorkedTransport, _Recording]:
    inner = _Recording()
    return CorkedTransport(inner, asyncio.get_running_loop()), inner  # type: ignore[arg-type]


async def test_writes_of_one_turn_leave_as_one() -> None:
    corked, inner = await _corked()
    corked.write(b"HTTP/1.1 200 OK\r\n\r\n")
    corked.write(b"body")
    assert inner.writes == []
    await asyncio.sleep(0)
    assert inner.writes == [b"HTTP/1.1 200 OK\r\n\r\nbody"]
    corked.write(b"next")
    await asyncio.sleep(0)
    assert inner.writes[1:] == [b"next"]


async def test_a_large_write_leaves_at_once() -> None:
    corked, inner = await _corked()
    corked.write(b"head")
    corked.write(bytearray(CORK_BYTES))
    assert inner.writes == [b"head" + bytes(CORK_BYTES)]
    await asyncio.sleep(0)
    assert len(inner.writes) == 1


async def test_close_writes_what_is_held_first() -> None:
    corked, inner = await _corked()
    corked.write(b"refused")
    corked.close()
    assert (inner.writes, inner.closing, corked.is_closing()) == ([b"refused"], True, True)
    await asyncio.sleep(0)
    assert inner.writes == [b"refused"]


async def test_nothing_is_written_to_a_closing_transport() -> None:
    corked, inner = await _corked()
    corked.write(b"late")
    inner.closing = True
    await asyncio.sleep(0)
    assert inner.writes == []


async def test_everything_else_is_the_transports() -> None:
    corked, _inner = await _corked()
    assert corked.get_extra_info("peername") == ("127.0.0.1", 1)
    assert corked.get_extra_info("socket", "none") == "none"
    assert corked.get_write_buffer_size() == 7
