"""The gateway's HTTP/1.1 protocol (:mod:`pd_orchestrator.gateway.protocol`) as a
client sees it: what uvicorn's own protocol did, kept now that the gateway serves on
its own. The protocol serves a small ASGI application here, in this process, on a
uvloop loop in a thread, behind a real uvicorn server on loopback; the client is a
plain socket, so every byte on the wire is the test's to check."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import shutil
import socket
import ssl
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import uvicorn
from starlette.types import Receive, Scope, Send
from uvicorn.server import ServerState

from pd_orchestrator.config.settings import LimitsConfig
from pd_orchestrator.gateway.protocol import HIGH_WATER, limited_protocol

from .helpers import ThreadServer

BIG_CHUNK = 256 * 1024
BIG_CHUNKS = 64
"""``/big`` streams 16 MiB: far past the socket buffers, so writes pause and resume."""


async def _read_body(receive: Receive) -> tuple[bytes, int]:
    body, messages = b"", 0
    while True:
        message = await receive()
        assert message["type"] == "http.request"
        body += message["body"]
        messages += 1
        if not message.get("more_body", False):
            return body, messages


async def _app(scope: Scope, receive: Receive, send: Send) -> None:
    """``/echo`` answers what it was asked; ``/chunked`` answers without a length;
    ``/fail`` raises before answering; ``/bad-header`` sends a value with a line
    feed; ``/big`` streams :data:`BIG_CHUNKS` chunks; anything else ``ok``."""
    if scope["type"] != "http":
        return
    path = scope["path"]
    if path == "/fail":
        raise RuntimeError("the application failed")
    if path == "/bad-header":
        await send({"type": "http.response.start", "status": 200, "headers": [(b"x-a", b"a\nb")]})
        return
    if path == "/chunked":
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"one,", "more_body": True})
        await send({"type": "http.response.body", "body": b"two", "more_body": False})
        return
    if path == "/big":
        headers = [(b"content-length", b"%d" % (BIG_CHUNK * BIG_CHUNKS))]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        for i in range(BIG_CHUNKS):
            chunk = bytes([i % 251]) * BIG_CHUNK
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
        return
    body, messages = await _read_body(receive)
    if path.startswith("/echo"):
        seen = {
            "path": scope["path"],
            "raw_path": scope["raw_path"].decode(),
            "query": scope["query_string"].decode(),
            "method": scope["method"],
            "version": scope["http_version"],
            "scheme": scope["scheme"],
            "bytes": len(body),
            "sha": hashlib.sha256(body).hexdigest(),
            "messages": messages,
        }
        content = json.dumps(seen).encode()
    else:
        content = b"ok"
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(content))]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": content})


@pytest.fixture(scope="module")
def served() -> Iterator[ThreadServer]:
    with ThreadServer(_app, LimitsConfig()).running() as served:
        yield served


def _connect(served: ThreadServer) -> socket.socket:
    return socket.create_connection(("127.0.0.1", served.port), timeout=20)


def _until_closed(sock: socket.socket) -> bytes:
    received = b""
    while chunk := sock.recv(1 << 20):
        received += chunk
    return received


def _answers(data: bytes) -> list[tuple[int, dict[str, str], bytes]]:
    """Every answer in ``data`` (framed by content-length or chunked)."""
    answers = []
    while data:
        head, _, rest = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = dict(line.lower().split(": ", 1) for line in lines[1:])
        status = int(lines[0].split(" ", 2)[1])
        if status == 100:
            data = rest
            continue
        if headers.get("transfer-encoding") == "chunked":
            body = b""
            while True:
                size_line, _, rest = rest.partition(b"\r\n")
                size = int(size_line, 16)
                body, rest = body + rest[:size], rest[size + 2 :]
                if size == 0:
                    break
        else:
            length = int(headers.get("content-length", "0"))
            body, rest = rest[:length], rest[length:]
        answers.append((status, headers, body))
        data = rest
    return answers


def _echo(path: str, body: bytes = b"", extra: bytes = b"", version: bytes = b"HTTP/1.1") -> bytes:
    return (
        b"POST %s %s\r\nhost: x\r\ncontent-length: %d\r\n%s\r\n"
        % (path.encode(), version, len(body), extra)
    ) + body


def test_requests_on_one_kept_alive_connection_are_each_answered(served: ThreadServer) -> None:
    with _connect(served) as sock:
        for i in range(3):
            sock.sendall(_echo(f"/echo/{i}", b"x" * i))
            received = b""
            while not received.endswith(b"}"):
                received += sock.recv(65536)
            status, headers, body = _answers(received)[0]
            assert (status, json.loads(body)["bytes"]) == (200, i)
            assert "connection" not in headers
            assert "date" in headers


def test_http_1_0_is_answered_and_closed(served: ThreadServer) -> None:
    with _connect(served) as sock:
        sock.sendall(_echo("/echo", b"abc", version=b"HTTP/1.0"))
        [(status, headers, body)] = _answers(_until_closed(sock))
    assert (status, headers["connection"], json.loads(body)["version"]) == (200, "close", "1.0")


def test_pipelined_requests_are_answered_in_order(served: ThreadServer) -> None:
    requests = [_echo(f"/echo/{i}", bytes([i]) * (i * 1000)) for i in range(5)]
    requests.append(_echo("/echo/last", extra=b"connection: close\r\n"))
    with _connect(served) as sock:
        sock.sendall(b"".join(requests))
        answers = _answers(_until_closed(sock))
    paths = [json.loads(body)["path"] for _, _, body in answers]
    assert paths == [*(f"/echo/{i}" for i in range(5)), "/echo/last"]
    assert [json.loads(body)["bytes"] for _, _, body in answers] == [0, 1000, 2000, 3000, 4000, 0]


def test_a_chunked_request_body_arrives_whole(served: ThreadServer) -> None:
    body = b"".join(bytes([i]) * 1000 for i in range(10))
    chunks = b"".join(b"%x\r\n%b\r\n" % (1000, body[i : i + 1000]) for i in range(0, 10_000, 1000))
    head = (
        b"POST /echo HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n"
    )
    with _connect(served) as sock:
        sock.sendall(head + chunks + b"0\r\n\r\n")
        [(status, _, answer)] = _answers(_until_closed(sock))
    seen = json.loads(answer)
    assert (status, seen["bytes"], seen["sha"]) == (200, 10_000, hashlib.sha256(body).hexdigest())


def test_a_body_past_the_high_water_mark_is_read_in_pieces_and_whole(served: ThreadServer) -> None:
    body = bytes(range(256)) * (4 * HIGH_WATER // 256)
    with _connect(served) as sock:
        sock.sendall(_echo("/echo", body, b"connection: close\r\n"))
        [(status, _, answer)] = _answers(_until_closed(sock))
    seen = json.loads(answer)
    assert (status, seen["bytes"], seen["sha"]) == (
        200,
        len(body),
        hashlib.sha256(body).hexdigest(),
    )


def test_expect_100_continue_is_answered_before_the_body_is_sent(served: ThreadServer) -> None:
    with _connect(served) as sock:
        sock.sendall(
            _echo("/echo", extra=b"expect: 100-continue\r\n").replace(b"length: 0", b"length: 5")
        )
        assert sock.recv(65536) == b"HTTP/1.1 100 Continue\r\n\r\n"
        sock.sendall(b"hello")
        received = b""
        while not received.endswith(b"}"):
            received += sock.recv(65536)
    [(status, _, body)] = _answers(received)
    assert (status, json.loads(body)["bytes"]) == (200, 5)


def test_the_target_is_split_and_percent_decoded(served: ThreadServer) -> None:
    with _connect(served) as sock:
        sock.sendall(_echo("/echo/a%20b?x=1&y=%20", extra=b"connection: close\r\n"))
        [(_, _, body)] = _answers(_until_closed(sock))
    seen = json.loads(body)
    assert (seen["path"], seen["raw_path"], seen["query"]) == (
        "/echo/a b",
        "/echo/a%20b",
        "x=1&y=%20",
    )


def test_head_is_answered_without_a_body(served: ThreadServer) -> None:
    with _connect(served) as sock:
        sock.sendall(
            b"HEAD /echo HTTP/1.1\r\nhost: x\r\n\r\nHEAD /echo HTTP/1.1\r\nhost: x\r\n\r\n"
        )
        time.sleep(0.2)
        sock.sendall(b"GET /ok HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        received = _until_closed(sock)
    heads = received.split(b"\r\n\r\n")
    assert heads[0].startswith(b"HTTP/1.1 200") and b"content-length: " in heads[0]
    assert heads[1].startswith(b"HTTP/1.1 200")  # the second HEAD's, right after the first
    assert heads[2].startswith(b"HTTP/1.1 200") and heads[3] == b"ok"


def test_an_answer_without_a_length_is_chunked(served: ThreadServer) -> None:
    with _connect(served) as sock:
        sock.sendall(b"GET /chunked HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        raw = _until_closed(sock)
    [(status, headers, body)] = _answers(raw)
    assert (status, headers["transfer-encoding"], body) == (200, "chunked", b"one,two")


@pytest.mark.parametrize("path", ["/fail", "/bad-header"])
def test_an_application_that_fails_before_answering_gets_a_500(
    served: ThreadServer, path: str
) -> None:
    with _connect(served) as sock:
        sock.sendall(b"GET %s HTTP/1.1\r\nhost: x\r\n\r\n" % path.encode())
        [(status, headers, body)] = _answers(_until_closed(sock))
    assert (status, headers["connection"], json.loads(body)["error"]["code"]) == (500, "close", 500)


def test_a_large_answer_to_a_slow_reader_arrives_whole_and_in_order(served: ThreadServer) -> None:
    with _connect(served) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 * 1024)
        sock.sendall(b"GET /big HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        time.sleep(0.3)  # the gateway's socket buffer fills: its writes pause
        [(status, _, body)] = _answers(_until_closed(sock))
    expected = b"".join(bytes([i % 251]) * BIG_CHUNK for i in range(BIG_CHUNKS))
    assert status == 200 and len(body) == len(expected) and body == expected


def test_an_upgrade_request_is_served_as_http_and_its_connection_closed(
    served: ThreadServer,
) -> None:
    head = b"GET /ok HTTP/1.1\r\nhost: x\r\nconnection: upgrade\r\nupgrade: websocket\r\n\r\n"
    with _connect(served) as sock:
        sock.sendall(head)
        [(status, _, body)] = _answers(_until_closed(sock))
    assert (status, body) == (200, b"ok")


def test_https_is_served_and_its_scheme_given(tmp_path: Path) -> None:
    """The sidecar's ``--secure-serving`` serves TLS: the protocol under uvicorn's
    TLS transport."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("no openssl to make a certificate with")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subject = ["-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"]
    files = ["-keyout", str(key), "-out", str(cert)]
    subprocess.run(
        [openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", *subject, *files],
        check=True,
        capture_output=True,
        timeout=60,
    )
    served = ThreadServer(_app, LimitsConfig(), ssl_certfile=str(cert), ssl_keyfile=str(key))
    context = ssl.create_default_context(cafile=str(cert))
    with served.running(), _connect(served) as raw:
        with context.wrap_socket(raw, server_hostname="127.0.0.1") as sock:
            sock.sendall(_echo("/echo", b"abc"))
            sock.sendall(_echo("/echo/2", b"defg", b"connection: close\r\n"))
            received = b""
            with contextlib.suppress(ssl.SSLEOFError):
                while chunk := sock.recv(65536):
                    received += chunk
    seen = [json.loads(body) for _, _, body in _answers(received)]
    assert [(s["path"], s["bytes"], s["scheme"]) for s in seen] == [
        ("/echo", 3, "https"),
        ("/echo/2", 4, "https"),
    ]


async def _nothing(scope: Scope, receive: Receive, send: Send) -> None:
    return None


def test_a_sender_cancelled_while_writes_wait_leaves_the_next_one_waiting() -> None:
    """A request cancelled while the client's buffer was full (its client went, the
    drain ended it) must not leave the next request on the connection a cancelled
    wait to fall through."""

    async def run() -> list[str]:
        loop = asyncio.get_running_loop()
        config = uvicorn.Config(_nothing, lifespan="off")
        connection = limited_protocol(lambda: LimitsConfig())(config, ServerState(), {}, loop)
        connection.pause_writing()
        first = asyncio.ensure_future(connection.drain())
        await asyncio.sleep(0)
        first.cancel()
        await asyncio.sleep(0)
        second = asyncio.ensure_future(connection.drain())
        await asyncio.sleep(0)
        waiting = "waiting" if not second.done() else "fell through"
        connection.resume_writing()
        await asyncio.wait_for(second, 5)
        return [waiting, "cancelled" if first.cancelled() else "not cancelled"]

    assert asyncio.run(run()) == ["waiting", "cancelled"]
