"""A hostile client against a real gateway on loopback: connector fields, the admin
token, upstream error text, limits and malformed input. Each test states the old
behaviour it guards against."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import anyio
import httpx
import orjson
import pytest

from pd_orchestrator.children import Child
from pd_orchestrator.openai.errors import error_body

from ..conftest import GatewayFactory, SimFactory, gateway_config
from .helpers import (
    MODEL,
    assert_error_shape,
    call,
    raw_error,
    raw_exchange,
    read_to_close,
)

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
    error = assert_error_shape(answer.body, 400)
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
    message = assert_error_shape(open_port.body, 502)["message"]
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
    error = assert_error_shape(answer.body, 502)
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
    assert assert_error_shape(answer.body, 400)["message"] == "The decoder prompt cannot be empty"


def _vllm_error(status: int, message: str) -> tuple[int, str, bytes]:
    return status, "application/json", orjson.dumps(error_body(message, status))


TRACEBACK = (
    b"<html><head><title>500</title></head><body><pre>Traceback (most recent call last):\n"
    b'  File "/srv/vllm/vllm/entrypoints/openai/api_server.py", line 812, in create\n'
    b"ValueError: bad request</pre></body></html>"
)
LEAKS: dict[str, tuple[tuple[int, str, bytes], str]] = {
    "ipv6": (_vllm_error(400, "KV pull from fe80::1%eth0 port 5600 refused"), "fe80::1%eth0"),
    "ipv6-full": (_vllm_error(422, "peer 2001:db8:0:1::17 sent nothing"), "2001:db8:0:1::17"),
    "host-name": (_vllm_error(400, "decoder gpu-node-17 is draining"), "gpu-node-17"),
    "dns-name": (
        _vllm_error(404, "model not on vllm-decode-3.inference.svc.cluster.local"),
        "vllm-decode-3.inference.svc.cluster.local",
    ),
    "path": (
        _vllm_error(400, 'File "/opt/vllm/entrypoints/serving_engine.py", line 42, in check'),
        "/opt/vllm/entrypoints/serving_engine.py",
    ),
    "html-traceback": ((400, "text/html", TRACEBACK), "Traceback (most recent call last)"),
    "not-json": (
        (413, "text/plain", b"request entity too large at /var/lib/nginx/body"),
        "/var/lib/nginx/body",
    ),
}
"""Upstream refusals whose text must not reach the client (the answer, and what of it
the log must show), by the ``leak`` field that asks the hostile upstream for them."""
SECRETS = (
    "fe80",
    "2001:db8",
    "gpu-node",
    "svc.cluster",
    "/opt/",
    "/srv/",
    "/var/",
    "<",
    "Traceback",
)
CONTEXT = _vllm_error(
    400,
    "This model's maximum context length is 2048 tokens. However, your request has 3000 "
    "input tokens. Please reduce the length of the input messages (see "
    "http://vllm-decode-3.inference.svc.cluster.local:8000/docs on gpu-node-17).",
)


class _Hostile:
    """An upstream on loopback that answers health checks and load polls, and every
    POST with the refusal its body's ``leak`` field names (:data:`LEAKS`, or
    :data:`CONTEXT` for ``context``)."""

    def __init__(self) -> None:
        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                self._answer(200, "text/plain", b"")

            def do_POST(self) -> None:
                body = orjson.loads(self.rfile.read(int(self.headers["content-length"])))
                leak = body.get("leak")
                self._answer(*(CONTEXT if leak == "context" else LEAKS[leak][0]))

            def _answer(self, status: int, content_type: str, content: bytes) -> None:
                self.send_response(status)
                self.send_header("content-type", content_type)
                self.send_header("content-length", str(len(content)))
                self.end_headers()
                self.wfile.write(content)

            def log_message(self, format: str, *args: Any) -> None:
                return None

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> _Hostile:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(5)


@pytest.fixture(scope="module")
def hostile(module_gateways: GatewayFactory) -> Iterator[Child]:
    """A gateway whose one decoder (and prefiller) is a :class:`_Hostile` upstream."""
    with _Hostile() as upstream:
        endpoint = {"url": upstream.url, "hardware": "h200", "model": MODEL}
        config = {
            "decoders": [{"name": "decode-0", **endpoint}],
            "prefillers": [{"name": "prefill-0", **endpoint}],
            "health": {"interval": 0.5},
        }
        yield module_gateways(config)


async def _refused(gateway: Child, route: str, leak: str) -> tuple[int, str, dict[str, Any]]:
    """Ask ``gateway`` on ``route`` for the upstream refusal ``leak``: status, the
    whole answer as text, its error object."""
    if route == "tokenize":
        async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:
            response = await client.post("/tokenize", json={"prompt": "hi", "leak": leak})
        status, text, body = response.status_code, response.text, response.json()
    else:
        request = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "leak": leak}
        answer = await call(gateway.url, "completion", request | {"stream": route == "stream"})
        status, text, body = answer.status, orjson.dumps(answer.body).decode(), answer.body
    return status, text, assert_error_shape(body, status)


@pytest.mark.parametrize("route", ["whole", "stream", "tokenize"])
@pytest.mark.parametrize("leak", list(LEAKS))
async def test_upstream_4xx_text_is_logged_not_echoed(
    hostile: Child, route: str, leak: str
) -> None:
    """An upstream refusal keeps its status; the client gets the gateway's words, the
    log the upstream's. Old: only a URL, an IPv4 address, a bracketed IPv6 address or
    ``host:port`` was held back -- plain IPv6, host names, file paths and HTML
    tracebacks reached the client."""
    status, text, error = await _refused(hostile, route, leak)
    (upstream_status, _, _), logged = LEAKS[leak]
    assert status == upstream_status
    phase = "tokenize" if route == "tokenize" else "decode_attempt"
    assert (
        error["message"] == f"decoder decode-0 refused the request during {phase} (HTTP {status})"
    )
    assert not [secret for secret in SECRETS if secret in text], text
    assert logged in hostile.log_tail(400)


@pytest.mark.parametrize("route", ["whole", "stream", "tokenize"])
async def test_a_context_length_refusal_is_told_in_the_gateways_words(
    hostile: Child, route: str
) -> None:
    """vLLM's context-length refusal is the one a client can act on: the gateway
    rewrites it from its numbers, and nothing else of the upstream's text passes."""
    status, text, error = await _refused(hostile, route, "context")
    assert status == 400
    assert error["message"] == (
        "This model's maximum context length is 2048 tokens; the request has 3000 input "
        "tokens. Reduce the prompt or max_tokens."
    )
    assert not [secret for secret in SECRETS if secret in text], text


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
        assert_error_shape(response.json(), 401)
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
        assert_error_shape(response.json(), 413)


def _chunked(path: str, body: bytes) -> bytes:
    """A whole request with ``body`` in chunks of 8 KiB."""
    head = f"POST {path} HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n".encode()
    pieces = [body[i : i + 8192] for i in range(0, len(body), 8192)]
    return head + b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/tokenize", {"model": MODEL, "prompt": "x" * 200_000}),
        ("/detokenize", {"model": MODEL, "tokens": [7] * 100_000}),
    ],
    ids=["tokenize", "detokenize"],
)
async def test_tokenizer_routes_refuse_a_body_over_the_limit(
    strict: Child, path: str, body: dict[str, Any]
) -> None:
    """The same limit as the completion routes, on the same path: 413 from a declared
    length, and as soon as a chunked body passes it. Old: a chunked body was read
    whole (300 MiB: the gateway grew to 660 MiB), then forwarded."""
    raw = orjson.dumps(body)
    declared = f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-length: {len(raw)}\r\n\r\n"
    for request in (declared.encode() + raw, _chunked(path, raw)):
        received = await anyio.to_thread.run_sync(raw_exchange, strict.port, request)
        status, error = raw_error(received)
        assert status == 413 and "exceeds 65536 bytes" in error["message"]
        head = received.partition(b"\r\n\r\n")[0].lower() + b"\r\n"
        assert b"\r\nconnection: close\r\n" in head


@pytest.fixture(scope="module")
def choices(fleet: tuple[Child, Child], module_gateways: GatewayFactory) -> Child:
    """At most 128 KiB for n times the body's size."""
    return module_gateways(
        gateway_config([fleet[0]], [fleet[1]], limits={"max_n_body_bytes": 131072})
    )


@pytest.mark.parametrize(("n", "status"), [(1, 200), (3, 200), (4, 400), (16, 400)])
async def test_n_times_the_body_is_bounded(choices: Child, n: int, status: int) -> None:
    """Each choice is a request of its own upstream, with its own copy of the body.
    Old: n=16 with a 15 MiB body was taken (+465 MiB for one request)."""
    body = {"model": MODEL, "prompt": "x" * 40_000, "max_tokens": 2, "n": n}
    answer = await call(choices.url, "completion", body)
    assert answer.status == status
    if status == 400:
        error = assert_error_shape(answer.body, 400)
        assert error["param"] == "n" and "exceeds 131072 bytes" in error["message"]


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
            assert_error_shape(response.json(), 431)


async def test_a_head_that_never_ends_is_cut_while_it_arrives(strict: Child) -> None:
    """A header value that grows forever: refused once past the limit, the connection
    closed (old: buffered whole by the server, no answer)."""
    received = await anyio.to_thread.run_sync(
        raw_exchange, strict.port, b"GET /health HTTP/1.1\r\nhost: x\r\nx-big: " + b"v" * 300_000
    )
    status, error = raw_error(received)
    assert status == 431 and "8192 bytes" in error["message"]


def _slow_exchange(child: Child, pieces: list[bytes]) -> bytes:
    """Send ``pieces`` as separate writes a little apart; the whole answer."""
    with socket.create_connection(("127.0.0.1", child.port), timeout=10) as sock:
        for piece in pieces:
            sock.sendall(piece)
            time.sleep(0.05)
        return read_to_close(sock)


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
    received = await anyio.to_thread.run_sync(raw_exchange, strict.port, b"NOT HTTP AT ALL\r\n\r\n")
    assert raw_error(received)[0] == 400


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
    error = assert_error_shape(response.json(), status)
    assert fragment is not None and fragment in error["message"]


async def test_too_many_messages(strict: Child) -> None:
    messages = [{"role": "user", "content": "hi"}] * 9
    answer = await call(strict.url, "chat", {"model": MODEL, "messages": messages})
    assert answer.status == 400 and assert_error_shape(answer.body, 400)["param"] == "messages"


def _tracebacks(child: Child) -> int:
    return child.log_path.read_text(errors="replace").count("Traceback")


_IDS = [7] * 65
TOKENIZER_BODIES = {
    "tokenize-depth-17": ("/tokenize", {"prompt": "p", "x": [[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]}),
    "tokenize-depth-301": ("/tokenize", b'{"prompt":"p","x":' + _nested(300) + b"}"),
    "detokenize-depth-301": ("/detokenize", b'{"tokens":[1],"x":' + _nested(300) + b"}"),
    "tokenize-depth-1101": ("/tokenize", b'{"prompt":"p","x":' + _nested(1100) + b"}"),
    "tokenize-messages": ("/tokenize", {"messages": [{"role": "user", "content": "hi"}] * 9}),
    "tokenize-ids": ("/tokenize", {"prompt": _IDS}),
    "detokenize-ids": ("/detokenize", {"tokens": _IDS}),
}


@pytest.mark.parametrize("case", list(TOKENIZER_BODIES))
async def test_tokenizer_routes_check_bodies_as_the_completion_routes(
    strict: Child, case: str
) -> None:
    """The same reading and checks as a completion's: 400 naming the limit, nothing
    forwarded, no traceback in the log. Old: 254-1023 levels deep was a 500 (``internal
    error: TypeError``, a traceback logged per request), 17-253 levels, 9 messages and
    65 token ids were forwarded upstream."""
    path, body = TOKENIZER_BODIES[case]
    raw = body if isinstance(body, bytes) else orjson.dumps({"model": MODEL, **body})
    traces = _tracebacks(strict)
    async with httpx.AsyncClient(base_url=strict.url, timeout=10) as client:
        fine = await client.post(path, json={"model": MODEL, "prompt": "p", "tokens": [1, 2]})
        response = await client.post(path, content=raw)
    assert fine.status_code == 200
    assert response.status_code == 400
    message = assert_error_shape(response.json(), 400)["message"]
    assert any(word in message for word in ("deeper", "depth", "more than")), message
    assert _tracebacks(strict) == traces


@pytest.mark.parametrize("route", ["completion", "chat", "tokenize"])
async def test_an_unknown_model_is_echoed_cut_short(strict: Child, route: str) -> None:
    """Old: the whole name came back in the 404 (1 MB for a 1 MB name)."""
    model = "m" * 50_000
    if route == "tokenize":
        async with httpx.AsyncClient(base_url=strict.url, timeout=10) as client:
            response = await client.post("/tokenize", json={"model": model, "prompt": "p"})
        status, body = response.status_code, response.json()
    else:
        prompt = (
            {"prompt": "p"}
            if route == "completion"
            else {"messages": [{"role": "user", "content": "p"}]}
        )
        answer = await call(strict.url, route, {"model": model, **prompt})
        status, body = answer.status, answer.body
    assert status == 404
    message = assert_error_shape(body, 404)["message"]
    assert len(message) < 400 and "m" * 256 + "..." in message


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
            assert_error_shape(response.json(), 400)


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
    assert_error_shape(response.json(), status)
    allowed = response.headers.get("allow")
    assert (allowed and set(allowed.split(", "))) == (allow and set(allow.split(", ")))
