"""A hostile client against a real gateway on loopback: connector fields, the admin
token, upstream error text, limits and malformed input. Each test states the old
behaviour it guards against."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import anyio
import httpx
import orjson
import pytest

from pd_orchestrator.children import Child

from ..conftest import GatewayFactory, SimFactory, gateway_config
from .helpers import MODEL, call

pytestmark = pytest.mark.anyio
NIXL = ("--profile", "instant", "--kv-connector", "nixl")
PROMPT = "a prompt that is long enough to span several blocks of the cache. " * 3
TOKEN = "s3cret-token"
LIMITS = {
    "max_body_bytes": 65536,
    "max_header_bytes": 8192,
    "max_headers": 40,
    "max_json_depth": 16,
    "max_messages": 8,
    "max_prompt_token_ids": 64,
}


@pytest.fixture(scope="module")
def fleet(module_sims: SimFactory) -> tuple[Child, Child]:
    return module_sims(*NIXL), module_sims(*NIXL)


@pytest.fixture(scope="module")
def strict(fleet: tuple[Child, Child], module_gateways: GatewayFactory) -> Child:
    """The default security settings, small limits and an admin token."""
    config = gateway_config([fleet[0]], [fleet[1]], limits=LIMITS, admin={"token": TOKEN})
    return module_gateways(config)


@pytest.fixture(scope="module")
def trusting(fleet: tuple[Child, Child], module_gateways: GatewayFactory) -> Child:
    config = gateway_config([fleet[0]], [fleet[1]], security={"trust_client_transfer_params": True})
    return module_gateways(config)


class _Listener:
    """A TCP port on loopback that counts connections (each closed at once)."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(TimeoutError):
                connection, _ = self.sock.accept()
                self.connections += 1
                connection.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


@contextlib.contextmanager
def _listener() -> Iterator[_Listener]:
    listener = _Listener()
    try:
        yield listener
    finally:
        listener.close()


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _pull_params(port: int) -> dict[str, Any]:
    """What a decoder takes as an order to pull KV from 127.0.0.1:``port``."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "engine",
        "remote_block_ids": [1, 2],
        "remote_request_id": "r",
        "remote_host": "127.0.0.1",
        "remote_port": port,
        "tp_size": 1,
    }


def _assert_error_shape(body: Any, status: int) -> dict[str, Any]:
    assert isinstance(body, dict) and set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and isinstance(error["type"], str)
    assert error["param"] is None or isinstance(error["param"], str)
    assert error["code"] == status
    return dict(error)


# -- client-supplied connector fields -------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize(
    ("field", "param"),
    [
        ("kv_transfer_params", "kv_transfer_params"),
        ("ec_transfer_params", "ec_transfer_params"),
        ("vllm_xargs", "vllm_xargs.kv_transfer_params"),
    ],
)
async def test_client_transfer_fields_are_refused_and_reach_no_host(
    strict: Child, field: str, param: str, stream: bool
) -> None:
    """Old: the decoder pulled KV from the host and port the client named."""
    with _listener() as listener:
        params = _pull_params(listener.port)
        value = {"kv_transfer_params": str(params)} if field == "vllm_xargs" else params
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "cache_hit_threshold": 0}
        answer = await call(strict.url, "completion", body | {field: value, "stream": stream})
        await anyio.sleep(0.3)
        assert listener.connections == 0
    assert answer.status == 400
    error = _assert_error_shape(answer.body, 400)
    assert error["param"] == param and "may not be set by a client" in error["message"]


async def test_trusted_callers_set_transfer_params_and_no_port_is_told_apart(
    trusting: Child,
) -> None:
    """With ``security.trust_client_transfer_params`` the params reach the decoder;
    whether the port they name is open or closed, the client gets the same answer.
    Old: the 502 carried the decoder's text (ReadError vs ConnectError, the URL)."""
    answers = []
    with _listener() as listener:
        for port in (listener.port, _closed_port()):
            body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4}
            body |= {"kv_transfer_params": _pull_params(port), "cache_hit_threshold": 0}
            answers.append(await call(trusting.url, "completion", body))
        assert listener.connections >= 1  # the decoder did follow the params
    open_port, closed_port = answers
    assert open_port.status == closed_port.status == 502
    assert open_port.body == closed_port.body
    message = _assert_error_shape(open_port.body, 502)["message"]
    assert message == "decoder decode-0 failed during decode_attempt (HTTP 500)"
    log = trusting.log_tail(200)
    assert "pd_orchestrator.upstream" not in message and "KV transfer failed" in log


# -- upstream error text -----------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("failing", ["decoder", "prefiller"])
async def test_upstream_5xx_text_is_logged_not_echoed(
    sim_factory: SimFactory, gateway_factory: GatewayFactory, failing: str, stream: bool
) -> None:
    """Old: '... HTTP 500: injected failure (--failure-rate)' reached the client. (A
    failed prefill side answers as such only without the decoder-alone fallback.)"""
    broken = (*NIXL, "--failure-rate", "1.0")
    decoder = sim_factory(*(broken if failing == "decoder" else NIXL))
    prefiller = sim_factory(*(broken if failing == "prefiller" else NIXL))
    upstream = {"retry_backoff": 0.01, "prefill_fallback": "error"}
    config = gateway_config([decoder], [prefiller], upstream=upstream)
    gateway = gateway_factory(config)
    cold = f"{time.monotonic_ns()} {PROMPT}"
    answer = await call(
        gateway.url, "completion", {"model": MODEL, "prompt": cold, "stream": stream}
    )
    assert answer.status == 502
    error = _assert_error_shape(answer.body, 502)
    name, phase = (
        ("decode-0", "decode_attempt") if failing == "decoder" else ("prefill-0", "prefill")
    )
    assert error["message"] == f"{failing} {name} failed during {phase} (HTTP 500)"
    assert "injected" not in error["message"]
    log = gateway.log_tail(50)
    assert "injected failure (--failure-rate)" in log and name in log


async def test_an_upstream_400_about_the_input_keeps_its_message(strict: Child) -> None:
    answer = await call(strict.url, "completion", {"model": MODEL, "prompt": "", "max_tokens": 2})
    assert answer.status == 400
    assert _assert_error_shape(answer.body, 400)["message"] == "The decoder prompt cannot be empty"


# -- the admin token ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("authorization", "status"),
    [
        (None, 401),
        (TOKEN, 401),  # old: accepted without the scheme
        (f"Bearer {TOKEN}", 200),
        (f"bearer {TOKEN}", 200),  # the scheme is case-insensitive (RFC 9110)
        (f"Bearer  {TOKEN}", 401),
        (f"Bearer {TOKEN}x", 401),
        (f"Basic {TOKEN}", 401),
        ("Bearer", 401),
    ],
    ids=["none", "bare", "bearer", "lower", "two-spaces", "longer", "basic", "empty"],
)
async def test_the_admin_api_takes_only_a_bearer_token(
    strict: Child, authorization: str | None, status: int
) -> None:
    headers = {"authorization": authorization} if authorization is not None else {}
    async with httpx.AsyncClient(base_url=strict.url, timeout=10) as client:
        response = await client.post("/admin/reload", headers=headers)
    assert response.status_code == status
    if status == 401:
        _assert_error_shape(response.json(), 401)
        assert response.headers["www-authenticate"] == "Bearer"


# -- limits ------------------------------------------------------------------------------------
async def test_a_body_over_the_limit_is_refused_before_it_is_read(strict: Child) -> None:
    """Old: no limit (a 20 MB body was parsed, copied and forwarded)."""
    big = orjson.dumps({"model": MODEL, "prompt": "x" * 70_000})

    async def chunks() -> Any:
        for start in range(0, len(big), 8192):
            yield big[start : start + 8192]

    async with httpx.AsyncClient(base_url=strict.url, timeout=10) as client:
        declared = await client.post("/v1/completions", content=big)
        chunked = await client.post("/v1/chat/completions", content=chunks())
    for response in (declared, chunked):
        assert response.status_code == 413
        assert response.headers["connection"] == "close"
        _assert_error_shape(response.json(), 413)


@pytest.mark.parametrize(
    "headers",
    [[(f"x-h{i}", "v") for i in range(50)], [("x-big", "v" * 9000)]],
    ids=["count", "bytes"],
)
async def test_a_head_over_the_limits_is_431(strict: Child, headers: list[tuple[str, str]]) -> None:
    """Old: 5,000 headers and a 1 MB header were accepted."""
    async with httpx.AsyncClient(base_url=strict.url, timeout=10) as client:
        for path in ("/health", "/v1/completions"):
            response = await client.request(
                "POST" if "v1" in path else "GET", path, headers=headers
            )
            assert response.status_code == 431
            _assert_error_shape(response.json(), 431)


def _raw_exchange(child: Child, data: bytes, *, timeout: float = 10) -> bytes:
    """Send ``data`` on a fresh connection; everything read until the server closes it."""
    with socket.create_connection(("127.0.0.1", child.port), timeout=timeout) as sock:
        with contextlib.suppress(ConnectionResetError, BrokenPipeError):
            sock.sendall(data)
        received = b""
        with contextlib.suppress(ConnectionResetError):
            while chunk := sock.recv(65536):
                received += chunk
    return received


def _raw_error(received: bytes) -> tuple[int, dict[str, Any]]:
    head, _, body = received.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    assert b"content-type: application/json" in head.lower()
    return status, _assert_error_shape(orjson.loads(body), status)


async def test_a_head_that_never_ends_is_cut_while_it_arrives(strict: Child) -> None:
    """A header value that grows forever: refused once past the limit, the connection
    closed (old: buffered whole by the server, no answer)."""
    received = await anyio.to_thread.run_sync(
        _raw_exchange, strict, b"GET /health HTTP/1.1\r\nhost: x\r\nx-big: " + b"v" * 300_000
    )
    status, error = _raw_error(received)
    assert status == 431 and "8192 bytes" in error["message"]


def _slow_exchange(child: Child, pieces: list[bytes]) -> bytes:
    """Send ``pieces`` as separate writes a little apart; the whole answer."""
    with socket.create_connection(("127.0.0.1", child.port), timeout=10) as sock:
        for piece in pieces:
            sock.sendall(piece)
            time.sleep(0.05)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
    return received


async def test_a_head_within_the_limits_is_served_however_it_arrives(strict: Child) -> None:
    """Names and values just under the limit, sent in pieces: the raw head (with its
    separators) is longer than the limit and must not be cut."""
    lines = b"".join(b"x-pad-%02d: %s\r\n" % (i, b"v" * 262) for i in range(30))
    head = b"GET /health HTTP/1.1\r\nhost: x\r\nconnection: close\r\n" + lines + b"\r\n"
    counted = len(b"/healthhostxconnectionclose") + 30 * len(b"x-pad-00" + b"v" * 262)
    assert 8100 < counted <= 8192 < len(head)
    pieces = [head[:4000], head[4000:-2], head[-2:]]  # incomplete past 8192 raw bytes
    received = await anyio.to_thread.run_sync(_slow_exchange, strict, pieces)
    assert received.startswith(b"HTTP/1.1 200 "), received[:200]


async def test_invalid_http_is_answered_in_the_error_shape(strict: Child) -> None:
    """Old: uvicorn's plain-text 'Invalid HTTP request received.'"""
    received = await anyio.to_thread.run_sync(_raw_exchange, strict, b"NOT HTTP AT ALL\r\n\r\n")
    assert _raw_error(received)[0] == 400


def _nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


@pytest.mark.parametrize(
    ("raw", "status", "fragment"),
    [
        (b'{"model":"sim-model","prompt":"p","x":' + _nested(15) + b"}", None, None),
        (b'{"model":"sim-model","prompt":"p","x":' + _nested(16) + b"}", 400, "deeper than 16"),
        (b'{"model":"sim-model","prompt":"p","x":' + _nested(300) + b"}", 400, "deeper"),
        (b'{"model":"sim-model","prompt":"p","x":' + _nested(1100) + b"}", 400, "depth"),
        (b'{"model":"sim-model","prompt":' + _nested(600) + b"}", 400, "prompt"),
        (
            orjson.dumps({"model": MODEL, "prompt": list(range(100, 165))}),
            400,
            "more than 64 token ids",
        ),
    ],
    ids=["depth-16", "depth-17", "depth-301", "depth-1101", "deep-prompt", "token-ids"],
)
async def test_deep_and_long_bodies(
    strict: Child, raw: bytes, status: int | None, fragment: str | None
) -> None:
    """Old: ~300 levels deep was a 500 (the JSON encoder's recursion limit)."""
    async with httpx.AsyncClient(base_url=strict.url, timeout=10) as client:
        response = await client.post("/v1/completions", content=raw)
    if status is None:
        assert response.status_code == 200
        return
    assert response.status_code == status
    error = _assert_error_shape(response.json(), status)
    assert fragment is not None and fragment in error["message"]


async def test_too_many_messages(strict: Child) -> None:
    messages = [{"role": "user", "content": "hi"}] * 9
    answer = await call(strict.url, "chat", {"model": MODEL, "messages": messages})
    assert answer.status == 400 and _assert_error_shape(answer.body, 400)["param"] == "messages"


# -- malformed input ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    "raw",
    [
        b'{"model":"sim-model","prompt":"p","temperature":NaN}',
        b'{"model":"sim-model","prompt":"p","top_p":Infinity}',
        b'{"model":"sim-model","prompt":"p","unknown":-Infinity}',
        b'{"model":"sim-model","prompt":"p","temperature":1e999}',
        b'{"model":"sim-model","prompt":"p","unknown":[1,2,-1e400]}',
        b'{"model":"sim-model","prompt":"x\\ud800"}',
        b'{"model":"sim-model","prompt":"p","unknown":{"k":"\\udfff"}}',
        b'{"model":"sim-model","prompt":"p","stop":["\\ud800x"]}',
        b'{"model":"sim-model","prompt":"\xed\xa0\x80"}',
        b'{"model":"sim-model","prompt":"\xff\xfe"}',
        b"",
        b"[]",
    ],
    ids=[
        "nan",
        "infinity",
        "minus-infinity",
        "1e999",
        "nested-1e400",
        "lone-high-surrogate",
        "lone-low-surrogate",
        "surrogate-in-stop",
        "utf8-surrogate",
        "invalid-utf8",
        "empty",
        "array",
    ],
)
async def test_malformed_bodies_are_400(strict: Child, raw: bytes) -> None:
    """Old (httpx upstream client): NaN, 1e999 and lone surrogates were 500s."""
    async with httpx.AsyncClient(base_url=strict.url, timeout=10) as client:
        for path in ("/v1/completions", "/v1/chat/completions"):
            response = await client.post(path, content=raw)
            assert response.status_code == 400
            _assert_error_shape(response.json(), 400)


@pytest.mark.parametrize(
    ("value", "echoed"),
    [
        (b"req-123_abc.9:x", True),
        ("é".encode() * 10, False),
        (b"\xff\xfe", False),
        (b"a" * 200, False),
        (b"two words", False),
        (b"", False),
    ],
    ids=["plain", "non-ascii", "latin1-bytes", "long", "spaces", "empty"],
)
async def test_request_ids_are_taken_only_when_plain(
    strict: Child, value: bytes, echoed: bool
) -> None:
    """Old: a non-ASCII or long x-request-id was forwarded verbatim (a 500)."""
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 2}
    headers = [(b"x-request-id", value)]
    async with httpx.AsyncClient(base_url=strict.url, timeout=10) as client:
        response = await client.post("/v1/completions", json=body, headers=headers)
    assert response.status_code == 200
    returned = response.headers["x-request-id"]
    assert (returned == value.decode("latin-1")) is echoed
    assert returned.isascii() and len(returned) <= 128


@pytest.mark.parametrize(
    ("method", "path", "status", "allow"),
    [
        ("GET", "/v1/completions", 405, "POST"),
        ("PUT", "/v1/chat/completions", 405, "POST"),
        ("POST", "/health", 405, "GET, HEAD"),
        ("DELETE", "/admin/reload", 405, "POST"),
        ("GET", "/nope", 404, None),
        ("POST", "/v1/completions/", 404, None),
        ("GET", "/v1/models/../../etc/passwd", 404, None),
    ],
)
async def test_unknown_routes_and_methods_use_the_error_shape(
    strict: Child, method: str, path: str, status: int, allow: str | None
) -> None:
    """Old: Starlette's plain-text 'Not Found' and 'Method Not Allowed'."""
    async with httpx.AsyncClient(base_url=strict.url, timeout=10) as client:
        response = await client.request(method, path)
    assert response.status_code == status
    _assert_error_shape(response.json(), status)
    allowed = response.headers.get("allow")
    assert (allowed and set(allowed.split(", "))) == (allow and set(allow.split(", ")))
