"""What a connection may hold, against a real gateway on loopback with raw sockets:
the time its head and its body may take (408), how long it may stay idle, and how
many connections may be open (503). Each test states the old behaviour it guards
against. The timeouts are small so that the tests are quick; each wait is bounded by
a socket timeout far above them, and no test measures how fast anything happened."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator

import anyio
import pytest

from pd_orchestrator.children import Child

from ..conftest import GatewayFactory, SimFactory, gateway_config
from .helpers import raw_error, raw_exchange, read_answer, read_to_close

pytestmark = pytest.mark.anyio
INSTANT = ("--profile", "instant")
TIMEOUTS = {"header_timeout": 0.5, "body_timeout": 0.5, "keepalive_timeout": 0.5}
BOUND = 20.0
"""Seconds a socket waits for the gateway: far above every timeout configured here."""
HEALTH = b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n"
LAST = b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n"


@pytest.fixture(scope="module")
def decoder(module_sims: SimFactory) -> Child:
    """One instance for both roles: these tests send no completion."""
    return module_sims(*INSTANT)


@pytest.fixture(scope="module")
def quick(decoder: Child, module_gateways: GatewayFactory) -> Child:
    """A gateway with half-second head, body and keep-alive timeouts."""
    return module_gateways(gateway_config([decoder], [decoder], limits=TIMEOUTS))


@contextlib.contextmanager
def _connection(child: Child) -> Iterator[socket.socket]:
    with socket.create_connection(("127.0.0.1", child.port), timeout=BOUND) as sock:
        yield sock


def _send_then_read(child: Child, first: bytes, then: bytes) -> bytes:
    """Send ``first`` and read its answer (the connection kept alive), then send
    ``then``; everything read after it until the gateway closes the connection."""
    with _connection(child) as sock:
        if first:
            sock.sendall(first)
            status, _, _ = read_answer(sock)
            assert status == 200
        sock.sendall(then)
        return read_to_close(sock)


async def test_a_connection_that_sends_nothing_is_closed(quick: Child) -> None:
    """Old: held open for as long as the client liked (130 s and more)."""
    assert await anyio.to_thread.run_sync(raw_exchange, quick.port, b"", BOUND) == b""


@pytest.mark.parametrize("first", [b"", HEALTH], ids=["first-request", "after-a-request"])
@pytest.mark.parametrize(
    "head",
    [b"GET /health HTTP/1.1\r\nhost: x\r\n", b"POST /v1/completions HTT"],
    ids=["headers", "request-line"],
)
async def test_a_half_sent_head_is_408(quick: Child, first: bytes, head: bytes) -> None:
    """Old: no answer, the connection held open."""
    received = await anyio.to_thread.run_sync(_send_then_read, quick, first, head)
    status, error = raw_error(received)
    assert status == 408 and "request head took more than 0.5 s" in error["message"]


@pytest.mark.parametrize(
    "request_",
    [
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b'content-length: 100\r\n\r\n{"model": "sim-model", ',
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
        b'10\r\n{"model": "sim-m\r\n',
        b"POST /tokenize HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n{",
    ],
    ids=["content-length", "chunked", "tokenize"],
)
async def test_a_half_sent_body_is_408(quick: Child, request_: bytes) -> None:
    """Old: the gateway waited for the rest of the body for ever."""
    received = await anyio.to_thread.run_sync(_send_then_read, quick, HEALTH, request_)
    status, error = raw_error(received)
    assert status == 408 and "request body took more than 0.5 s" in error["message"]


async def test_an_idle_keep_alive_connection_is_closed(quick: Child) -> None:
    """After ``limits.keepalive_timeout`` without a request the connection is closed
    without a word (old: uvicorn's fixed 5 s, not configurable)."""
    assert await anyio.to_thread.run_sync(_send_then_read, quick, HEALTH, b"") == b""


async def test_a_whole_request_is_served_on_the_same_connection(quick: Child) -> None:
    """The timeouts cut nothing that arrives: two requests, one connection."""

    def exchange() -> tuple[int, int]:
        with _connection(quick) as sock:
            sock.sendall(HEALTH)
            first = read_answer(sock)[0]
            sock.sendall(HEALTH)
            return first, read_answer(sock)[0]

    assert await anyio.to_thread.run_sync(exchange) == (200, 200)


# -- the connection cap ----------------------------------------------------------------------
CAP = 3


@pytest.fixture(scope="module")
def capped(decoder: Child, module_gateways: GatewayFactory) -> Child:
    """A gateway that takes at most three connections (and lets idle ones stay)."""
    limits = {"max_connections": CAP, "header_timeout": 60.0, "keepalive_timeout": 60.0}
    return module_gateways(gateway_config([decoder], [decoder], limits=limits))


def _held(child: Child, count: int) -> list[socket.socket]:
    """``count`` connections, each with one answered request and kept open."""
    held = []
    for _ in range(count):
        sock = socket.create_connection(("127.0.0.1", child.port), timeout=BOUND)
        held.append(sock)
        sock.sendall(HEALTH)
        assert read_answer(sock)[0] == 200
    return held


async def test_a_connection_past_the_cap_is_503_and_closed(capped: Child) -> None:
    """Old: every connection was taken until the process ran out of file descriptors,
    then new ones got a bare reset."""
    held = await anyio.to_thread.run_sync(_held, capped, CAP)
    try:
        received = await anyio.to_thread.run_sync(raw_exchange, capped.port, LAST, BOUND)
        status, error = raw_error(received)
        assert status == 503 and "too many connections" in error["message"]
    finally:
        held.pop().close()  # one slot frees; the others stay held
    try:

        async def served() -> bool:
            received = await anyio.to_thread.run_sync(raw_exchange, capped.port, LAST, BOUND)
            return received.startswith(b"HTTP/1.1 200 ")

        with anyio.fail_after(BOUND):
            while not await served():  # noqa: ASYNC110 - the gateway's close shows no event
                await anyio.sleep(0.05)
    finally:
        for sock in held:
            sock.close()
