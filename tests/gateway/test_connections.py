"""What a connection may hold, against a real gateway on loopback with raw sockets:
the time its head and its body may take (408), how long it may stay idle, and how
many connections may be open (503). Each test states the old behaviour it guards
against. The timeouts are small so that the tests are quick; each wait is bounded by
a socket timeout far above them, and no test measures how fast anything happened."""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Iterator
from functools import partial

import anyio
import pytest

from pd_orchestrator.bench.peers import free_port
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


SLOW = {"max_connections": CAP, "header_timeout": 60.0, "keepalive_timeout": 60.0}
"""A cap of three, and connections that may idle or hold a half-sent head for a minute."""
PARTIAL = b"GET /health HTTP/1.1\r\nhost: x\r\n"
"""A head begun and never ended: the connection is busy (not idle) until its timeout."""


@pytest.fixture(scope="module")
def capped(decoder: Child, module_gateways: GatewayFactory) -> Child:
    """A gateway that takes at most three connections, all from one client if it likes."""
    limits = {**SLOW, "max_connection_share": 1.0}
    return module_gateways(gateway_config([decoder], [decoder], limits=limits))


def _held(
    child: Child, count: int, *, busy: bool = True, source: str = "127.0.0.1", port: int = 0
) -> list[socket.socket]:
    """``count`` connections from ``source``, each with one answered request and kept
    open: ``busy``, with a half-sent head after it, else idle."""
    held = []
    for _ in range(count):
        sock = _served(("127.0.0.1", port or child.port), source)
        held.append(sock)
        if busy:
            sock.sendall(PARTIAL)
    return held


def _served(address: tuple[str, int], source: str) -> socket.socket:
    """A connection whose ``GET /health`` was answered 200, kept open: tried again
    while the gateway answers 503 (the connections of an earlier test may not have
    been closed on its side yet), within :data:`BOUND` seconds."""
    deadline = time.monotonic() + BOUND
    while True:
        sock = socket.create_connection(address, timeout=BOUND, source_address=(source, 0))
        sock.sendall(HEALTH)
        status = read_answer(sock)[0]
        if status == 200:
            return sock
        sock.close()
        assert status == 503 and time.monotonic() < deadline, status
        time.sleep(0.05)


def _exchange_from(port: int, source: str, data: bytes = LAST) -> bytes:
    """``raw_exchange`` from the loopback address ``source``."""
    address = ("127.0.0.1", port)
    with socket.create_connection(address, timeout=BOUND, source_address=(source, 0)) as sock:
        sock.sendall(data)
        return read_to_close(sock)


async def test_a_connection_past_the_cap_is_503_and_closed(capped: Child) -> None:
    """With every held connection busy. Old: every connection was taken until the
    process ran out of file descriptors, then new ones got a bare reset."""
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


async def test_at_the_cap_the_longest_idle_connection_makes_room(capped: Child) -> None:
    """Cap-many keep-alive connections that each sent a request and idle (a client
    sending ``GET /health`` every few seconds on each) do not lock others out: a new
    connection closes the longest idle one and is served. Old: 503 for everyone, the
    probes included, for as long as the idle connections were kept."""
    held = await anyio.to_thread.run_sync(partial(_held, capped, CAP, busy=False))
    try:
        received = await anyio.to_thread.run_sync(raw_exchange, capped.port, LAST, BOUND)
        assert received.startswith(b"HTTP/1.1 200 "), received[:200]
        assert await anyio.to_thread.run_sync(read_to_close, held[0]) == b""  # the oldest
        held[1].sendall(HEALTH)  # the others are still served
        assert (await anyio.to_thread.run_sync(read_answer, held[1]))[0] == 200
    finally:
        for sock in held:
            sock.close()


SHARED = 4


@pytest.fixture(scope="module")
def shared(decoder: Child, module_gateways: GatewayFactory) -> Child:
    """A cap of four, at most half of it (two) from one client address."""
    limits = {**SLOW, "max_connections": SHARED, "max_connection_share": 0.5}
    return module_gateways(gateway_config([decoder], [decoder], limits=limits))


async def test_one_client_holds_at_most_its_share_of_the_cap(shared: Child) -> None:
    """Busy connections from one address fill its share, not the cap: a third from it
    is 503 (in words about that client), another address is still served. Old: one
    client could hold every connection."""
    held = await anyio.to_thread.run_sync(_held, shared, SHARED // 2)
    try:
        received = await anyio.to_thread.run_sync(_exchange_from, shared.port, "127.0.0.1")
        status, error = raw_error(received)
        assert status == 503 and "this client has too many connections" in error["message"]
        received = await anyio.to_thread.run_sync(_exchange_from, shared.port, "127.0.0.2")
        assert received.startswith(b"HTTP/1.1 200 "), received[:200]
    finally:
        for sock in held:
            sock.close()


@pytest.fixture(scope="module")
def probed(decoder: Child, module_gateways: GatewayFactory) -> tuple[Child, int]:
    """A capped gateway with a probe port; the gateway and that port."""
    probe_port = free_port()
    limits = {**SLOW, "max_connection_share": 1.0}
    config = gateway_config([decoder], [decoder], limits=limits, listen={"probe_port": probe_port})
    return module_gateways(config), probe_port


def _probe_status(port: int, path: str) -> int:
    request = f"GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n".encode()
    received = raw_exchange(port, request, BOUND)
    return int(received.split(b" ", 2)[1])


async def test_the_probe_port_answers_whatever_the_main_port_holds(
    probed: tuple[Child, int],
) -> None:
    """With the main port's cap held by busy connections, the probe port still answers
    ``/health``, ``/ready`` and ``/metrics`` (and nothing else). Old: no probe port; the
    Kubernetes probes on the main port failed and the gateway was restarted."""
    gateway, probe_port = probed
    held = await anyio.to_thread.run_sync(_held, gateway, CAP)
    try:
        received = await anyio.to_thread.run_sync(raw_exchange, gateway.port, LAST, BOUND)
        assert raw_error(received)[0] == 503
        for path in ("/health", "/metrics", "/health?verbose=1"):
            assert await anyio.to_thread.run_sync(_probe_status, probe_port, path) == 200
        with anyio.fail_after(BOUND):  # ready once the fleet was checked
            while await anyio.to_thread.run_sync(_probe_status, probe_port, "/ready") != 200:  # noqa: ASYNC110 - readiness shows no event
                await anyio.sleep(0.1)
        assert await anyio.to_thread.run_sync(_probe_status, probe_port, "/v1/models") == 404
    finally:
        for sock in held:
            sock.close()


# -- pipelining ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def delayed(module_sims: SimFactory, module_gateways: GatewayFactory) -> Child:
    """A gateway with half-second timeouts over a decoder that answers after 2 s."""
    decoder = module_sims(*INSTANT, "--response-delay", "2")
    return module_gateways(gateway_config([decoder], [decoder], limits=TIMEOUTS))


async def test_a_pipelined_half_head_waits_for_the_answer_before_it(delayed: Child) -> None:
    """A second request head, half sent behind a stream, has its header timeout from
    the end of that stream: the stream ends with ``[DONE]``, then the half head gets
    its 408. Old: the half head's timer closed the connection under the stream at the
    header timeout, without an error event or ``[DONE]``."""
    body = b'{"model": "sim-model", "prompt": "hello", "max_tokens": 4, "stream": true}'
    first = (
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%s" % (len(body), body)
    )
    received = await anyio.to_thread.run_sync(raw_exchange, delayed.port, first + PARTIAL, BOUND)
    stream, _, after = received.partition(b"HTTP/1.1 408 ")
    assert stream.startswith(b"HTTP/1.1 200 ") and b"data: [DONE]" in stream, received[-300:]
    assert b"request head took more than 0.5 s" in after
