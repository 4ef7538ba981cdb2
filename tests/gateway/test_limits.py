"""The request limits and the admission refusals, as pure functions."""

from __future__ import annotations

import logging
from typing import Any

import orjson
import pytest
from starlette.types import Message

from pd_orchestrator.config.settings import LimitsConfig
from pd_orchestrator.flows.sink import GatewayError
from pd_orchestrator.gateway.admission import refuse_transfer_fields
from pd_orchestrator.gateway.limits import check_head, check_json, json_depth_exceeds, read_body
from pd_orchestrator.gateway.response import error_of

LIMITS = LimitsConfig(
    max_body_bytes=2048,
    max_header_bytes=1024,
    max_headers=10,
    max_json_depth=8,
    max_messages=3,
    max_prompt_token_ids=5,
)


def _scope(headers: list[tuple[bytes, bytes]], path: bytes = b"/v1/completions") -> Any:
    return {"type": "http", "headers": headers, "raw_path": path, "query_string": b""}


def _status(call: Any, *args: Any) -> int | None:
    try:
        call(*args)
    except GatewayError as exc:
        return exc.status
    return None


@pytest.mark.parametrize(
    ("headers", "path", "status"),
    [
        ([(b"host", b"x"), (b"content-length", b"2048")], b"/", None),
        ([(b"x-h%d" % i, b"v") for i in range(11)], b"/", 431),
        ([(b"x-big", b"v" * 1000)], b"/", None),
        ([(b"x-big", b"v" * 1100)], b"/", 431),
        ([], b"/" + b"p" * 1100, 431),
        ([(b"content-length", b"2049")], b"/", 413),
        ([(b"content-length", b"9" * 900)], b"/", 413),  # no int() of 900 digits
        ([(b"content-length", b"nonsense")], b"/", None),  # the server refuses it
    ],
    ids=["fits", "count", "bytes-fit", "bytes", "path", "length", "length-digits", "length-nan"],
)
def test_check_head(headers: list[tuple[bytes, bytes]], path: bytes, status: int | None) -> None:
    assert _status(check_head, _scope(headers, path), LIMITS) == status


class _Receive:
    """An ASGI ``receive`` that hands out the given chunks and counts its calls."""

    def __init__(self, *chunks: bytes, disconnect: bool = False) -> None:
        self.messages: list[Message] = [
            {"type": "http.request", "body": c, "more_body": i < len(chunks) - 1}
            for i, c in enumerate(chunks)
        ]
        if disconnect:
            self.messages.append({"type": "http.disconnect"})
        self.calls = 0

    async def __call__(self) -> Message:
        self.calls += 1
        return self.messages.pop(0)


@pytest.mark.anyio
async def test_read_body_stops_at_the_limit() -> None:
    assert await read_body(_Receive(b"a" * 1000, b"b" * 1048), 2048) == b"a" * 1000 + b"b" * 1048
    receive = _Receive(b"a" * 1500, b"b" * 1500, b"c" * 1500)
    with pytest.raises(GatewayError) as error:
        await read_body(receive, 2048)
    assert error.value.status == 413 and receive.calls == 2  # the third chunk is never read
    with pytest.raises(GatewayError, match="disconnected"):
        await read_body(_Receive(disconnect=True), 2048)


def _nested(depth: int, inner: Any = 0) -> Any:
    value = inner
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize(
    ("body", "skip", "deeper"),
    [
        ({"model": "m", "x": _nested(7)}, "", False),  # body + 7 = 8 levels
        ({"model": "m", "x": _nested(8)}, "", True),
        ({"model": "m", "x": {"a": {"b": _nested(6)}}}, "", True),
        ({"prompt": _nested(50)}, "prompt", False),  # validation refuses it as a prompt
        ({"prompt": _nested(50)}, "", True),
        ({"messages": [{"role": "u", "extra": _nested(7)}]}, "prompt", True),
        ({"x": _nested(1000)}, "", True),  # no recursion, whatever the depth
    ],
    ids=[
        "at-limit",
        "past-limit",
        "mixed",
        "prompt-skipped",
        "prompt-walked",
        "in-message",
        "1000",
    ],
)
def test_json_depth(body: dict[str, Any], skip: str, deeper: bool) -> None:
    assert json_depth_exceeds(body, LIMITS.max_json_depth, skip) is deeper


def test_json_depth_agrees_with_orjson_levels() -> None:
    raw = b'{"x":' + b"[" * 7 + b"]" * 7 + b"}"  # 8 levels as orjson counts them
    assert not json_depth_exceeds(orjson.loads(raw), 8)
    assert json_depth_exceeds(orjson.loads(b'{"x":' + b"[" * 8 + b"]" * 8 + b"}"), 8)


@pytest.mark.parametrize(
    ("body", "kind", "status", "param"),
    [
        ({"prompt": [1, 2, 3, 4, 5]}, "completion", None, None),
        ({"prompt": [1, 2, 3, 4, 5, 6]}, "completion", 400, "prompt"),
        ({"messages": [{}, {}, {}]}, "chat", None, None),
        ({"messages": [{}, {}, {}, {}]}, "chat", 400, "messages"),
        ({"prompt": _nested(20)}, "completion", None, None),  # left to validation
        ({"prompt": _nested(20)}, "chat", 400, None),  # chat does not validate prompt
    ],
    ids=["ids-fit", "ids", "messages-fit", "messages", "completion-prompt", "chat-prompt"],
)
def test_check_json(body: dict[str, Any], kind: Any, status: int | None, param: str | None) -> None:
    try:
        check_json(body, LIMITS, kind)
    except GatewayError as exc:
        assert (exc.status, exc.param) == (status, param)
    else:
        assert status is None


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({}, None),
        ({"kv_transfer_params": None}, None),  # null sets nothing
        ({"kv_transfer_params": {"do_remote_decode": True}}, "kv_transfer_params"),
        ({"kv_transfer_params": {}}, "kv_transfer_params"),
        ({"ec_transfer_params": {"remote_host": "h"}}, "ec_transfer_params"),
        ({"vllm_xargs": {"kv_transfer_params": "x"}}, "vllm_xargs.kv_transfer_params"),
        ({"vllm_xargs": {"kv_cache_report_mode": "full"}}, "vllm_xargs.kv_cache_report_mode"),
        ({"vllm_xargs": {"my_extension": 1}}, None),
    ],
    ids=["none", "null", "kv", "kv-empty", "ec", "xargs-kv", "xargs-report", "xargs-other"],
)
def test_transfer_fields_are_refused(extra: dict[str, Any], param: str | None) -> None:
    body = {"model": "m", "prompt": "p"} | extra
    try:
        refuse_transfer_fields(body)
    except GatewayError as exc:
        assert exc.status == 400 and exc.param == param
        assert "may not be set by a client" in exc.message
    else:
        assert param is None


def _raise(exc: Exception) -> Exception:
    try:
        raise exc
    except Exception as raised:
        return raised


def test_unexpected_errors_log_their_traceback_once_per_place(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A client that sets off the same unexpected error again and again gets one
    traceback in the log, then one line each; an encoder's refusal of a body is the
    client's (400, no traceback). Old: a traceback at ERROR per request."""
    caplog.set_level(logging.INFO, "pd_orchestrator.gateway")
    errors = [_raise(KeyError(f"k{i}")) for i in range(3)]  # all raised at one place
    assert [error_of(e)[0] for e in errors] == [500, 500, 500]
    traced = [r for r in caplog.records if r.levelno == logging.ERROR and r.exc_info]
    assert len(traced) == 1
    assert sum(r.levelno == logging.ERROR for r in caplog.records) == 3
    caplog.clear()
    status, message, _ = error_of(_raise(orjson.JSONEncodeError("Recursion limit reached")))
    assert status == 400 and "cannot be forwarded" in message
    assert not any(r.exc_info for r in caplog.records)
