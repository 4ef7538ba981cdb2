"""HTTP helpers for gateway tests (real servers on loopback)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Self

import httpx
import orjson
import uvicorn
import uvloop

from pd_orchestrator.config.settings import LimitsConfig
from pd_orchestrator.gateway.protocol import limited_protocol

MODEL = "sim-model"


@dataclass
class Answer:
    """A client's view of one answer, streamed or not."""

    status: int
    headers: httpx.Headers
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    chunks: list[dict[str, Any]] = field(default_factory=list)
    body: dict[str, Any] | None = None

    @property
    def decision(self) -> str | None:
        return self.headers.get("x-pd-decision")


def _choice_text(kind: str, choice: dict[str, Any], streamed: bool) -> str:
    if kind == "completion":
        return str(choice.get("text") or "")
    part = choice.get("delta" if streamed else "message") or {}
    return str(part.get("content") or "")


async def call(
    base_url: str, kind: str, body: dict[str, Any], headers: dict[str, str] | None = None
) -> Answer:
    """POST to the completions or chat route; collects a stream into an :class:`Answer`."""
    path = "/v1/completions" if kind == "completion" else "/v1/chat/completions"
    async with httpx.AsyncClient(base_url=base_url, timeout=30) as client:
        if not body.get("stream"):
            response = await client.post(path, json=body, headers=headers)
            data = response.json()
            answer = Answer(response.status_code, response.headers, body=data)
            if response.status_code == 200:
                choice = data["choices"][0]
                answer.text = _choice_text(kind, choice, streamed=False)
                answer.token_ids = choice.get("token_ids") or []
                answer.finish_reason = choice["finish_reason"]
                answer.usage = data["usage"]
            return answer
        async with client.stream("POST", path, json=body, headers=headers) as response:
            answer = Answer(response.status_code, response.headers)
            raw = (await response.aread()).decode()
    if answer.status != 200:
        answer.body = json.loads(raw)
        return answer
    events = [e[len("data: ") :] for e in raw.split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "[DONE]", events[-3:]
    for event in events[:-1]:
        chunk = json.loads(event)
        answer.chunks.append(chunk)
        if "error" in chunk:
            answer.body = chunk
            continue
        if chunk.get("usage"):
            answer.usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            answer.text += _choice_text(kind, choice, streamed=True)
            answer.token_ids += choice.get("token_ids") or []
            if choice.get("finish_reason"):
                answer.finish_reason = choice["finish_reason"]
    return answer


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of the samples of ``name`` whose labels include ``labels``."""
    total = 0.0
    found = False
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        metric_name = line.split("{", 1)[0].split(" ", 1)[0]
        if metric_name != name:
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
            found = True
    if not found:
        raise AssertionError(f"{name} {labels} not found")
    return total


async def metrics_text(base_url: str) -> str:
    async with httpx.AsyncClient(base_url=base_url, timeout=10) as client:
        return (await client.get("/metrics")).text


def assert_error_shape(body: Any, status: int) -> dict[str, Any]:
    """``body`` is vLLM's error shape with ``code`` ``status``; its ``error`` object."""
    assert isinstance(body, dict) and set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and isinstance(error["type"], str)
    assert error["param"] is None or isinstance(error["param"], str)
    assert error["code"] == status
    return dict(error)


def raw_exchange(port: int, data: bytes, timeout: float = 10) -> bytes:
    """Send ``data`` on a fresh connection to ``port`` on loopback; everything read
    until the server closes it (a socket timeout if it never does)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        with contextlib.suppress(ConnectionResetError, BrokenPipeError):
            sock.sendall(data)
        return read_to_close(sock)


def read_to_close(sock: socket.socket) -> bytes:
    """Everything ``sock`` receives until the server closes the connection."""
    received = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            received += chunk
    return received


def raw_error(received: bytes) -> tuple[int, dict[str, Any]]:
    """The status and error object of a raw JSON error answer."""
    head, _, body = received.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    assert b"content-type: application/json" in head.lower()
    return status, assert_error_shape(orjson.loads(body), status)


def read_answer(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One answer with a ``content-length`` read off a kept-alive connection: status,
    headers (lower-case names), body."""
    received = b""
    while b"\r\n\r\n" not in received:
        chunk = sock.recv(65536)
        assert chunk, f"the connection closed before an answer: {received!r}"
        received += chunk
    head, _, body = received.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    while len(body) < int(headers["content-length"]):
        chunk = sock.recv(65536)
        assert chunk, "the connection closed in the middle of an answer"
        body += chunk
    return int(lines[0].split(" ", 2)[1]), headers, body


class ThreadServer:
    """The gateway's HTTP protocol (``limits``) serving ``app`` behind a real uvicorn
    server on loopback, on a uvloop loop in a thread of this process: a test can
    then reach into the loop (:attr:`loop`) while a plain socket talks to it.
    ``options``: more of uvicorn's settings (``ssl_certfile``...)."""

    def __init__(self, app: Any, limits: LimitsConfig, **options: Any) -> None:
        protocol = limited_protocol(lambda: limits)
        config = uvicorn.Config(
            app,
            http=protocol,  # type: ignore[arg-type]
            lifespan="off",
            log_level="critical",
            **options,
        )
        self.server = uvicorn.Server(config)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.listener.getsockname()[1]
        self.loop = uvloop.new_event_loop()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self.server.serve(sockets=[self.listener]))

    @contextlib.contextmanager
    def running(self) -> Iterator[Self]:
        """Serve until the block ends, then stop the server and its thread."""
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.01)
        assert self.server.started
        try:
            yield self
        finally:
            self.server.should_exit = True
            self.thread.join(20)
            self.loop.close()
            self.listener.close()
