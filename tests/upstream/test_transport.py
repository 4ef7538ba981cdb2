"""The HTTP/1.1 transport against small real servers on loopback."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest

from pd_orchestrator.upstream.transport import (
    ConnectFailed,
    ConnectionBroken,
    HttpTransport,
    Origin,
    PoolTimedOut,
    ReadTimedOut,
    Request,
    Timeouts,
    _Connection,
)

pytestmark = pytest.mark.anyio
TIMEOUTS = Timeouts(connect=2.0, read=2.0, pool=2.0)

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@asynccontextmanager
async def server(handler: Handler) -> AsyncIterator[tuple[Origin, list[int]]]:
    """A loopback server running ``handler`` per connection; yields its origin and a
    list that counts accepted connections."""
    accepted: list[int] = []

    async def connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(1)
        try:
            await handler(reader, writer)
        finally:
            writer.close()

    srv = await asyncio.start_server(connection, "127.0.0.1", 0)
    port = srv.sockets[0].getsockname()[1]
    try:
        yield Origin("http", "127.0.0.1", port), accepted
    finally:
        srv.close()


async def _request_body(reader: asyncio.StreamReader) -> bytes | None:
    head = await reader.readuntil(b"\r\n\r\n") if not reader.at_eof() else b""
    if not head:
        return None
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return await reader.readexactly(length)


def keep_alive(body: bytes = b'{"ok":true}') -> Handler:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                if await _request_body(reader) is None:
                    return
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
            await writer.drain()

    return handle


def _post(origin: Origin, content: bytes = b"{}") -> Request:
    return Request("POST", origin, "/v1/completions", content)


async def test_keep_alive_connections_are_reused() -> None:
    async with server(keep_alive()) as (origin, accepted):
        transport = HttpTransport()
        for _ in range(5):
            response = await transport.send(_post(origin), TIMEOUTS)
            assert response.status == 200 and await response.read() == b'{"ok":true}'
        await transport.aclose()
    assert len(accepted) == 1


async def test_a_chunked_answer_is_read_piece_by_piece() -> None:
    async def chunked(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _request_body(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        for piece in (b"data: 1\n\n", b"data: 2\n\n"):
            writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            await writer.drain()
            await asyncio.sleep(0.05)
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(1)

    async with server(chunked) as (origin, _):
        transport = HttpTransport()
        response = await transport.send(_post(origin), TIMEOUTS)
        pieces = [piece async for piece in response]
        await transport.aclose()
    assert b"".join(pieces) == b"data: 1\n\ndata: 2\n\n" and len(pieces) == 2


async def test_an_answer_read_to_its_end_reads_nothing_of_the_next() -> None:
    """Its connection went back to the pool at the end: iterating the answer again
    must not read the answer of the request that reuses the connection."""
    async with server(keep_alive()) as (origin, accepted):
        transport = HttpTransport()
        first = await transport.send(_post(origin), TIMEOUTS)
        assert await first.read() == b'{"ok":true}'
        second = await transport.send(_post(origin), TIMEOUTS)
        assert [piece async for piece in first] == []
        assert await second.read() == b'{"ok":true}'
        await transport.aclose()
    assert len(accepted) == 1


async def test_a_connection_closed_while_idle_is_replaced_once() -> None:
    async def one_then_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _request_body(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()
        await asyncio.sleep(0.1)  # then close: the client still holds it as idle

    async with server(one_then_close) as (origin, accepted):
        transport = HttpTransport()
        first = await transport.send(_post(origin), TIMEOUTS)
        assert await first.read() == b"ok"
        await asyncio.sleep(0.3)
        second = await transport.send(_post(origin), TIMEOUTS)
        assert await second.read() == b"ok"
        await transport.aclose()
    assert len(accepted) == 2


@pytest.mark.source_only
@pytest.mark.parametrize("anyio_backend", [("asyncio", {"use_uvloop": True})], ids=["uvloop"])
async def test_a_connection_lost_before_its_request_is_written_is_a_broken_connection(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The server went away between the connect and the write (a decoder killed just
    then): the send is :class:`ConnectionBroken`, as any early close is. uvloop raised
    RuntimeError on the write, which once escaped the health checks and stopped them."""
    async with server(keep_alive()) as (origin, _):
        transport = HttpTransport()
        pool = transport._pool(origin)
        connect = pool._connect

        async def lost_at_once(seconds: float) -> Any:
            connection = await connect(seconds)
            assert connection.transport is not None
            connection.transport.abort()
            await asyncio.sleep(0.05)  # its loss is delivered before the write
            return connection

        monkeypatch.setattr(pool, "_connect", lost_at_once)
        with pytest.raises(ConnectionBroken):
            await transport.send(_post(origin), TIMEOUTS)
        await transport.aclose()


async def test_a_refused_connection_is_connect_failed() -> None:
    async with server(keep_alive()) as (origin, _):
        pass  # closed: nothing listens there any more
    with pytest.raises(ConnectFailed):
        await HttpTransport().send(_post(origin), TIMEOUTS)


async def test_no_answer_within_the_read_timeout() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _request_body(reader)
        await asyncio.sleep(5)

    async with server(silent) as (origin, _):
        transport = HttpTransport()
        with anyio.fail_after(3), pytest.raises(ReadTimedOut):
            await transport.send(_post(origin), Timeouts(connect=2.0, read=0.2, pool=2.0))
        await transport.aclose()


async def test_an_answer_cut_short_is_a_broken_connection() -> None:
    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _request_body(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly a part")
        await writer.drain()

    async with server(cut) as (origin, _):
        transport = HttpTransport()
        response = await transport.send(_post(origin), TIMEOUTS)
        with pytest.raises(ConnectionBroken):
            await response.read()
        await transport.aclose()


async def test_the_pool_limit_makes_requests_wait_then_time_out() -> None:
    release = asyncio.Event()

    async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _request_body(reader)
        await release.wait()
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        await writer.drain()

    async with server(slow) as (origin, accepted):
        transport = HttpTransport(max_connections=1)
        first = asyncio.ensure_future(transport.send(_post(origin), TIMEOUTS))
        await asyncio.sleep(0.1)
        with pytest.raises(PoolTimedOut):
            await transport.send(_post(origin), Timeouts(connect=2.0, read=2.0, pool=0.2))
        release.set()
        response = await first
        assert await response.read() == b"ok"
        await transport.aclose()
    assert len(accepted) == 1


async def test_closing_an_answer_early_closes_its_connection() -> None:
    async def endless(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _request_body(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        try:
            while True:
                writer.write(b"2\r\nok\r\n")
                await writer.drain()
                await asyncio.sleep(0.01)
        except ConnectionError:
            closed.set()

    closed = asyncio.Event()
    async with server(endless) as (origin, _):
        transport = HttpTransport()
        response = await transport.send(_post(origin), TIMEOUTS)
        async for _ in response:
            break
        await response.aclose()
        with anyio.fail_after(3):
            await closed.wait()
        await transport.aclose()


def _connections() -> int:
    return sum(1 for o in gc.get_objects() if isinstance(o, _Connection))


async def test_finished_connections_are_freed_without_the_cycle_collector() -> None:
    """A connection that broke, or that its server closed after the answer, is in no
    reference cycle: it is freed (with the answer and the failure it last held) as soon
    as the pool lets go of it, not at a full collection, which the gateway's collector
    thresholds make rare (the soak's gateway grew by the hour)."""

    async def cut_or_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        body = await _request_body(reader)
        if body == b"cut":
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly a part")
        else:
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok")
        await writer.drain()

    requests, broken = 40, 0
    gc.collect()
    before = _connections()
    gc.disable()  # what is left must be freed by reference counting alone
    try:
        async with server(cut_or_close) as (origin, accepted):
            transport = HttpTransport()
            for i in range(requests):
                response = await transport.send(_post(origin, b"cut" if i % 2 else b"{}"), TIMEOUTS)
                try:
                    assert await response.read() == b"ok"
                except ConnectionBroken:
                    broken += 1
                finally:
                    await response.aclose()
            del response
            await transport.aclose()
        for _ in range(10):  # every loss delivered
            await asyncio.sleep(0)
        left = _connections() - before
    finally:
        gc.enable()
    assert len(accepted) == requests and broken == requests // 2
    assert left == 0


@pytest.mark.parametrize(
    "anyio_backend",
    ["asyncio", ("asyncio", {"use_uvloop": True})],
    ids=["asyncio", "uvloop"],
)
async def test_a_refused_connect_leaves_no_reference_cycle() -> None:
    """A refused connect (a decoder killed, its port closed) is freed by reference
    counting: the connect's error, its traceback and ``asyncio.wait_for``'s future
    would otherwise be a cycle (the future holds the error, whose traceback holds the
    frame that holds the future), about 20 objects per refusal kept until a full
    collection: 50 a minute while a decoder was down in the soak."""
    async with server(keep_alive()) as (origin, _):
        pass  # closed: nothing listens there any more
    transport = HttpTransport()
    gc.collect()
    gc.disable()  # what is left must be freed by reference counting alone
    try:
        gc.collect()  # nothing of before counts
        for _ in range(10):
            with pytest.raises(ConnectFailed):
                await transport.send(_post(origin), TIMEOUTS)
        await transport.aclose()
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        left = [type(o).__name__ for o in gc.garbage if isinstance(o, BaseException)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert left == []
