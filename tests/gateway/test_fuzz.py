"""Fuzzing a real gateway process on loopback, over simulator processes.

Hypothesis draws OpenAI bodies with hostile values, random JSON, deep nesting, huge
numbers, lone surrogates and NaN tokens written into the raw bytes, raw byte bodies,
headers (huge, many, non-ASCII, ``x-request-id`` variants), ``Authorization``
variants on ``/admin/reload`` and raw HTTP requests. Every answer must be below 500;
every error must be ``{"error": {"message", "type", "param", "code"}}`` with
``code`` equal to the status (SSE error events included); the gateway must answer
``/health`` after each test. Bounded: a fixed number of examples, derandomized,
no deadline, no example database. The statuses seen are printed at the end of the
module (``fuzz statuses``).
"""

from __future__ import annotations

import contextlib
import json
import re
import socket
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pd_orchestrator.children import Child

from ..conftest import GatewayFactory, SimFactory, gateway_config
from .helpers import MODEL

TOKEN = "fuzz-admin-token"
PATHS = ("/v1/completions", "/v1/chat/completions")
SIM = ("--profile", "instant", "--kv-connector", "nixl", "--num-kv-blocks", "512")
COUNTS: dict[str, Counter[int]] = {}

RAW_TOKENS = (
    b"NaN",
    b"-NaN",
    b"Infinity",
    b"-Infinity",
    b"1e999",
    b"-1e999",
    b"1E+400",
    b"1e-999",
    b"123456789012345678901234567890",
    b"-9223372036854775809",
    b"18446744073709551616",
    b"9007199254740993",
    b"-0",
    b"0.1e1",
    b"1" * 400,
    b'"\\ud800"',
    b'"x\\udfff"',
    b'"\\udc00\\ud800"',
    b'"\\ud83d\\ude00"',
    b'"\\u0000"',
    b'"\\uFFFF"',
    b'"\xed\xa0\x80"',
    b'"\xff"',
    b'"\xc0\xaf"',
    b"tru",
    b"nul",
    b"[1,]",
    b"{,}",
)
_RAW = re.compile(rb'"@@raw:(\d+)@@"')


def settings_for(examples: int) -> Callable[[Any], Any]:
    return settings(
        max_examples=examples,
        derandomize=True,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


# -- values ---------------------------------------------------------------------------------------
raw_token = st.integers(0, len(RAW_TOKENS) - 1).map(lambda i: f"@@raw:{i}@@")
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=30),
    st.sampled_from(["", " ", "\x00", "\u202e", "\ufeff", "💥" * 40, "a" * 5000]),
    raw_token,
)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
small_ints = st.integers(1, 8)
hostile_ints = st.sampled_from([0, -1, 2**31, 2**63, 10**30, 1e308, 8.5, "8", True, None, "x"])


def _often(good: st.SearchStrategy[Any], bad: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """``good`` seven times in eight, ``bad`` otherwise."""
    return st.sampled_from([False] * 7 + [True]).flatmap(lambda hostile: bad if hostile else good)


prompt = _often(
    st.text(min_size=1, max_size=120),
    st.one_of(
        st.lists(st.integers(-5, 40_000), max_size=20),
        st.lists(st.integers(-(2**70), 2**70), min_size=4, max_size=8),
        st.lists(json_values, max_size=3),
        json_values,
        raw_token,
    ),
)
content = _often(
    st.text(max_size=80),
    st.one_of(
        st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=20)})),
        st.lists(st.dictionaries(st.text(max_size=6), json_values, max_size=3), max_size=3),
        json_values,
    ),
)
message = _often(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant"]), "content": content}
    ),
    st.one_of(st.dictionaries(st.text(max_size=8), json_values, max_size=3), json_values),
)
OPTIONAL = {
    "temperature": _often(st.floats(0, 2), json_values),
    "top_p": _often(st.floats(0.01, 1), json_values),
    "stream": _often(st.booleans(), json_values),
    "stream_options": _often(st.fixed_dictionaries({"include_usage": st.booleans()}), json_values),
    "n": _often(st.just(1), json_values),
    "stop": _often(st.lists(st.text(max_size=5), max_size=2), json_values),
    "seed": _often(st.integers(0, 2**32), json_values),
    "min_tokens": _often(st.integers(0, 2), hostile_ints),
    "ignore_eos": _often(st.booleans(), json_values),
    "return_token_ids": _often(st.booleans(), json_values),
    "cache_hit_threshold": _often(st.floats(0, 1), json_values),
    "logprobs": json_values,
    "kv_transfer_params": json_values,
    "ec_transfer_params": json_values,
    "vllm_xargs": st.dictionaries(st.sampled_from(["kv_transfer_params", "x"]), json_values),
    "x-unknown": json_values,
    "user": json_values,
}


@st.composite
def openai_bodies(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    chat = draw(st.booleans())
    body: dict[str, Any] = {
        "model": draw(_often(st.just(MODEL), json_values)),
        "max_tokens": draw(_often(small_ints, hostile_ints)),
    }
    if chat:
        body["messages"] = draw(_often(st.lists(message, min_size=1, max_size=4), json_values))
    else:
        body["prompt"] = draw(prompt)
    for name in draw(st.lists(st.sampled_from(sorted(OPTIONAL)), max_size=5, unique=True)):
        body[name] = draw(OPTIONAL[name])
    if draw(st.integers(0, 9)) == 0:
        del body[draw(st.sampled_from(sorted(body)))]  # a required field missing, sometimes
    return PATHS[chat], body


def encode(value: Any) -> bytes:
    """JSON bytes of ``value`` with its raw-token markers replaced by the raw tokens."""
    raw = json.dumps(value, ensure_ascii=False, allow_nan=False).encode()
    return _RAW.sub(lambda match: RAW_TOKENS[int(match.group(1))], raw)


# -- headers --------------------------------------------------------------------------------------
_FRAMING = {
    "content-length",
    "transfer-encoding",
    "host",
    "connection",
    "upgrade",
    "expect",
    "te",
    "trailer",
    "keep-alive",
}
header_names = st.from_regex(r"\A[!#$%&'*+\-.^_`|~0-9A-Za-z]{1,24}\Z").filter(
    lambda name: name.lower() not in _FRAMING
)
_VALUE_BYTES = bytes([9, *range(0x20, 0x7F), *range(0x80, 0x100)])
header_values = st.one_of(
    st.binary(max_size=60).map(
        lambda b: bytes(c for c in b if c in _VALUE_BYTES).strip(b" \t") or b"v"
    ),
    st.sampled_from([b"\xc3\xa9" * 40, b"\xff\xfe", b"a" * 9000, b"b" * 70_000, "😀".encode()]),
)
request_ids = st.one_of(
    st.from_regex(r"\A[A-Za-z0-9._:\-]{1,128}\Z").map(str.encode),
    header_values,
    st.sampled_from([b"a" * 129, b"../../etc", b"id with spaces", b"\xe2\x80\xae"]),
)
headers = st.lists(st.tuples(header_names.map(str.encode), header_values), max_size=6).flatmap(
    lambda small: st.one_of(
        st.just(small),
        st.integers(90, 130).map(lambda n: small + [(b"x-many-%d" % i, b"v") for i in range(n)]),
        request_ids.map(lambda rid: [*small, (b"x-request-id", rid)]),
        st.sampled_from([b"application/json", b"text/plain", b"\xff"]).map(
            lambda ct: [*small, (b"content-type", ct)]
        ),
    )
)


# -- the fleet under test -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gateway(module_sims: SimFactory, module_gateways: GatewayFactory) -> Iterator[Child]:
    decoders, prefiller = [module_sims(*SIM), module_sims(*SIM)], module_sims(*SIM)
    config = gateway_config(
        decoders, [prefiller], admin={"token": TOKEN}, limits={"max_body_bytes": 262_144}
    )
    # Every prefix path sees the hostile prompts (two decoders, so routing scores them):
    # both scorers, CBOR block hashes (64-bit ids only), the decoder's /tokenize.
    scorers = [
        {"type": "precise-prefix", "weight": 2, "params": {"share_slack": None}},
        {"type": "approximate-prefix", "weight": 1, "params": {"share_slack": None}},
    ]
    config["routing"] = {"decode": {"scorers": scorers}}
    config["prefix"] = {
        "precise": {
            "block_size": 4,
            "hash_algo": "sha256_cbor",
            "tokenize": True,
            "events": {"publisher": None},
        }
    }
    gateway = module_gateways(config)
    yield gateway
    assert gateway.process.poll() is None, gateway.log_tail()


@pytest.fixture(scope="module", autouse=True)
def report(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    total: Counter[int] = Counter()
    lines = []
    for name, counts in COUNTS.items():
        total.update(counts)
        lines.append(f"  {name}: {sum(counts.values())} requests, {dict(sorted(counts.items()))}")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if reporter is None or capture is None or not COUNTS:
        return
    with capture.global_and_fixture_disabled():
        reporter.write_line("")
        reporter.write_line(
            f"fuzz statuses: {sum(total.values())} requests, {dict(sorted(total.items()))}"
        )
        for line in lines:
            reporter.write_line(line)


@pytest.fixture
def client(gateway: Child) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=gateway.url, timeout=30) as client:
        yield client
    health = httpx.get(f"{gateway.url}/health", timeout=10)
    assert health.status_code == 200 and health.json() == {"status": "ok"}


# -- checks ---------------------------------------------------------------------------------------
def _assert_error(body: Any, status: int) -> None:
    assert isinstance(body, dict) and set(body) == {"error"}, body
    error = body["error"]
    assert isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["type"], str) and error["type"], error
    assert error["param"] is None or isinstance(error["param"], str), error
    assert error["code"] == status, (error, status)


def _check(status: int, content_type: str, content: bytes) -> None:
    assert status < 500, content[:500]
    if content_type.startswith("text/event-stream"):
        assert status == 200 and content.endswith(b"data: [DONE]\n\n"), content[-300:]
        for event in content.split(b"\n\n"):
            if not event.startswith(b"data: {"):
                continue
            chunk = orjson.loads(event[6:])
            if "error" in chunk:
                _assert_error(chunk, chunk["error"].get("code", 0))
                assert chunk["error"]["code"] < 500, chunk
        return
    if status >= 400:
        assert content_type.startswith("application/json"), (status, content_type, content[:200])
        _assert_error(orjson.loads(content), status)


def _send(
    client: httpx.Client, test: str, method: str, path: str, content: bytes | None, head: Any
) -> int:
    with client.stream(method, path, content=content, headers=head) as response:
        data = response.read()
    _check(response.status_code, response.headers.get("content-type", ""), data)
    COUNTS.setdefault(test, Counter())[response.status_code] += 1
    return response.status_code


# -- the tests ------------------------------------------------------------------------------------
def test_fuzz_openai_bodies(client: httpx.Client) -> None:
    @settings_for(200)
    @given(openai_bodies(), _often(st.just([]), headers))
    def run(case: tuple[str, dict[str, Any]], head: list[tuple[bytes, bytes]]) -> None:
        path, body = case
        _send(client, "openai bodies", "POST", path, encode(body), head)

    run()


def test_fuzz_random_json(client: httpx.Client) -> None:
    @settings_for(60)
    @given(st.sampled_from(PATHS), json_values)
    def run(path: str, value: Any) -> None:
        _send(client, "random json", "POST", path, encode(value), None)

    run()


def test_fuzz_raw_bytes(client: httpx.Client) -> None:
    valid = orjson.dumps({"model": MODEL, "prompt": "hello there", "max_tokens": 4})

    @settings_for(60)
    @given(
        st.sampled_from(PATHS),
        st.one_of(
            st.binary(max_size=300),
            st.tuples(st.integers(0, len(valid)), st.binary(max_size=6)).map(
                lambda cut: valid[: cut[0]] + cut[1] + valid[cut[0] + len(cut[1]) :]
            ),
            st.sampled_from(RAW_TOKENS),
        ),
    )
    def run(path: str, raw: bytes) -> None:
        _send(client, "raw bytes", "POST", path, raw, None)

    run()


def test_fuzz_nesting_and_size(client: httpx.Client) -> None:
    @settings_for(50)
    @given(
        st.sampled_from(PATHS),
        st.sampled_from(["prompt", "messages", "x", "stream_options", "tools"]),
        st.integers(1, 1500),
        st.sampled_from([b"[", b'{"a":']),
        st.booleans(),
    )
    def run(path: str, field: str, depth: int, opener: bytes, balanced: bool) -> None:
        closer = b"]" if opener == b"[" else b"}"
        inner = opener * depth + b"1" + closer * (depth if balanced else depth // 2)
        raw = b'{"model":"sim-model","max_tokens":2,"prompt":"p","messages":[{"role":"user",'
        raw += b'"content":"hi"}],"' + field.encode() + b'":' + inner + b"}"
        _send(client, "nesting", "POST", path, raw, None)

    run()
    big = b'{"model":"sim-model","prompt":"' + b"x" * 300_000 + b'"}'
    assert _send(client, "nesting", "POST", PATHS[0], big, None) == 413


def test_fuzz_headers(client: httpx.Client) -> None:
    routes = [
        ("GET", "/health"),
        ("GET", "/v1/models"),
        ("GET", "/status"),
        ("GET", "/metrics"),
        ("GET", "/ready"),
        ("POST", "/v1/completions"),
        ("GET", "/v1/completions"),
    ]
    body = orjson.dumps({"model": MODEL, "prompt": "hello", "max_tokens": 2})

    @settings_for(60)
    @given(st.sampled_from(routes), headers)
    def run(route: tuple[str, str], head: list[tuple[bytes, bytes]]) -> None:
        method, path = route
        _send(client, "headers", method, path, body if method == "POST" else None, head)

    run()


def test_fuzz_admin_authorization(client: httpx.Client) -> None:
    valid = f"Bearer {TOKEN}".encode()
    candidates = st.one_of(
        header_values,
        st.sampled_from(
            [
                TOKEN.encode(),
                valid,
                b"bearer " + TOKEN.encode(),
                b"Bearer  " + TOKEN.encode(),
                b"Bearer " + TOKEN.encode() + b"x",
                b"Bearer " + TOKEN[:-1].encode(),
                b"Basic " + TOKEN.encode(),
                b"Bearer",
                b"Token " + TOKEN.encode(),
                valid + b"\xff",
            ]
        ),
    )

    @settings_for(30)
    @given(st.lists(candidates, max_size=2))
    def run(values: list[bytes]) -> None:
        head = [(b"authorization", value) for value in values]
        status = _send(client, "admin", "POST", "/admin/reload", None, head)
        accepted = bool(values) and values[0] in (valid, b"bearer " + TOKEN.encode())
        oversized = sum(len(value) for value in values) > 65_536
        assert status == (431 if oversized else 200 if accepted else 401), status

    run()


def _raw_exchange(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        with contextlib.suppress(ConnectionResetError, BrokenPipeError):
            sock.sendall(data)
        received = b""
        with contextlib.suppress(ConnectionResetError, TimeoutError):
            while chunk := sock.recv(65536):
                received += chunk
    return received


def test_fuzz_raw_http(gateway: Child, client: httpx.Client) -> None:
    methods = st.sampled_from([b"GET", b"POST", b"PUT", b"DELETE", b"OPTIONS", b"HEAD", b"BREW"])
    paths = st.one_of(
        st.sampled_from([p.encode() for p in (*PATHS, "/health", "/admin/reload", "/nope")]),
        st.binary(min_size=1, max_size=40).map(
            lambda b: b"/" + bytes(c for c in b if c > 0x20 and c not in b"#?")
        ),
        st.sampled_from([b"/%ff%fe", b"/%00", b"/v1/%63ompletions", b"*", b"http://x/health"]),
    )
    versions = st.sampled_from([b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2.0", b"HTTP/1.1x", b""])

    @settings_for(40)
    @given(methods, paths, versions, st.binary(max_size=80), st.booleans())
    def run(method: bytes, path: bytes, version: bytes, body: bytes, lengthy: bool) -> None:
        head = method + b" " + path + b" " + version + b"\r\nhost: x\r\nconnection: close\r\n"
        if lengthy:
            head += b"content-length: %d\r\n" % len(body)
        received = _raw_exchange(gateway.port, head + b"\r\n" + (body if lengthy else b""))
        if not received:
            return  # the server closed without a word (uvicorn on a request it cannot start)
        status_line, _, rest = received.partition(b"\r\n")
        status = int(status_line.split(b" ")[1])
        fields, _, content = rest.partition(b"\r\n\r\n")
        lowered = fields.lower()
        kind = b"application/json" if b"content-type: application/json" in lowered else b""
        if b"transfer-encoding: chunked" in lowered or method == b"HEAD":
            content = b"{}" if status < 400 else content
        if status >= 400 and method != b"HEAD":
            _check(status, kind.decode(), content)
        assert status < 500
        COUNTS.setdefault("raw http", Counter())[status] += 1

    run()
