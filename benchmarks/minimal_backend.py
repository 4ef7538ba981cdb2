"""A minimal OpenAI-compatible backend: the baseline of the overhead benchmark.

It answers every completion at once with ``COMPLETION_TOKENS`` tokens (fewer when
``max_tokens`` asks for fewer), ``finish_reason: "length"``, so what a relay in
front of it adds is all that differs between the targets. Run it as a script::

    python benchmarks/minimal_backend.py --port 0     # prints "READY http://127.0.0.1:PORT"

Routes (anything else is a 404 in vLLM's error shape, logged once per path to stderr):

* ``POST /v1/completions``, ``POST /v1/chat/completions`` -- whole JSON, or with
  ``stream: true`` server-sent events: one chunk per token (chat: a role chunk
  first), a usage chunk when ``stream_options.include_usage``, then
  ``data: [DONE]``. With ``return_token_ids: true`` each choice carries
  ``token_ids`` and the prompt's ids ride on ``choices[0].prompt_token_ids``
  (completions) or top-level ``prompt_token_ids`` (chat), on the first chunk of a
  stream -- vLLM's shapes. ``cache_hit_threshold`` is ignored: every request is
  admitted. Prompt ids come from the simulator's tokenizer.
* ``GET /health``, ``GET /health_generate``, ``GET /v1/models``, ``GET /version``,
  ``GET /metrics`` (idle ``vllm:`` gauges labelled with ``model_name``, and
  ``minimal_backend_completions_total``, ``minimal_backend_answers_built_total``,
  ``minimal_backend_unknown_requests_total{path}``),
  ``GET /loads`` and ``GET /v1/loads`` (SGLang's load report, idle: SMG polls it),
  ``GET /get_model_info``, ``GET /get_server_info`` -- what the gateway and the
  peer routers probe.

Cost per request is kept as low as Python allows: uvloop, a raw ``asyncio.Protocol``
with httptools' parser, and answers memoized by (path, body) -- a load generator
repeating one body pays for the parse, one dict lookup and one write.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import time
from collections.abc import Callable
from typing import Any, cast

import httptools
import uvloop

from pd_orchestrator.openai.errors import error_body
from pd_orchestrator.openai.protocol import (
    ChatCompletionRequest,
    OpenAIRequest,
    RequestError,
    decode_json_object,
    parse_for,
    render_chat,
)
from pd_orchestrator.openai.responses import (
    Kind,
    Usage,
    completion_body,
    stream_chunk,
    usage_chunk,
)
from pd_orchestrator.openai.sse import DONE, encode_event
from pd_orchestrator.sim.tokenizer import WORD_BASE, SimTokenizer

__all__ = ["COMPLETION_TOKENS", "MODEL", "Answers", "main", "serve"]

MODEL = "overhead-model"
COMPLETION_TOKENS = 16
MAX_MODEL_LEN = 8192
_CACHE_LIMIT = 4096
_UNKNOWN_LIMIT = 64
_OUTPUT_IDS = tuple(range(WORD_BASE + 100, WORD_BASE + 100 + COMPLETION_TOKENS))
_KINDS: dict[bytes, Kind] = {b"/v1/completions": "completion", b"/v1/chat/completions": "chat"}
_IDLE_RANK = {
    "dp_rank": 0,
    "num_running_reqs": 0,
    "num_waiting_reqs": 0,
    "num_total_reqs": 0,
    "num_used_tokens": 0,
    "max_total_num_tokens": MAX_MODEL_LEN * 64,
    "token_usage": 0.0,
}
_REASONS = {200: b"OK", 400: b"Bad Request", 404: b"Not Found", 405: b"Method Not Allowed"}


def _json(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


def whole(status: int, content_type: bytes, body: bytes) -> bytes:
    """A complete HTTP/1.1 response with a ``content-length``."""
    head = b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n" % (
        status,
        _REASONS.get(status, b"Error"),
        content_type,
        len(body),
    )
    return head + body


def chunked(events: list[bytes]) -> bytes:
    """A 200 ``text/event-stream`` response, one HTTP chunk per event, terminated."""
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n"
    parts = [head, b"cache-control: no-cache\r\n\r\n"]
    for event in events:
        parts.append(b"%x\r\n%s\r\n" % (len(event), event))
    parts.append(b"0\r\n\r\n")
    return b"".join(parts)


def error(status: int, message: str, param: str | None = None) -> bytes:
    return whole(status, b"application/json", _json(error_body(message, status, param=param)))


def _response_id(kind: Kind) -> str:
    return "cmpl-minimal" if kind == "completion" else "chatcmpl-minimal"


def _metrics(model: str, served: int, built: int, unknown: dict[bytes, int]) -> bytes:
    """Idle vLLM gauges, and the backend's own counters: completions served, answers
    built, requests to unknown paths by path."""
    label = f'{{model_name="{model}"}}'
    lines = []
    for name, kind, help_text, value in (
        ("vllm:num_requests_running", "gauge", "always 0: answers are instant", 0),
        ("vllm:num_requests_waiting", "gauge", "always 0: answers are instant", 0),
        ("vllm:kv_cache_usage_perc", "gauge", "always 0: answers are instant", 0),
        ("vllm:num_preemptions_total", "counter", "always 0", 0),
        ("minimal_backend_completions_total", "counter", "completion requests answered", served),
        ("minimal_backend_answers_built_total", "counter", "answers built (memo misses)", built),
    ):
        base = name.removesuffix("_total")
        lines += [f"# HELP {base} {help_text}", f"# TYPE {base} {kind}"]
        lines.append(f"{name}{label} {float(value)}")
    name = "minimal_backend_unknown_requests"
    lines += [f"# HELP {name} requests no route serves", f"# TYPE {name} counter"]
    for path, count in unknown.items():
        quoted = json.dumps(path.decode(errors="replace"))
        lines.append(f"{name}_total{{path={quoted}}} {float(count)}")
    return ("\n".join(lines) + "\n").encode()


class Answers:
    """What the backend sends for a request: a pure function of (method, path, body),
    memoized for POSTs by (path, body) up to ``_CACHE_LIMIT`` entries."""

    def __init__(self, model: str = MODEL) -> None:
        self.model = model
        self.tokenizer = SimTokenizer()
        self.cache: dict[tuple[bytes, bytes], bytes] = {}
        self.unknown: dict[bytes, int] = {}
        self.served = 0
        self.built = 0
        created = int(time.time())
        card = {
            "id": model,
            "object": "model",
            "created": created,
            "owned_by": "vllm",
            "root": model,
            "parent": None,
            "max_model_len": MAX_MODEL_LEN,
        }
        info = {"model_path": model, "tokenizer_path": None, "is_generation": True}
        server = {"model_path": model, "served_model_name": model, "max_total_num_tokens": 0}
        loads = _json({"dp_rank_count": 1, "loads": [_IDLE_RANK]})
        self.gets: dict[bytes, bytes] = {
            b"/health": whole(200, b"application/json", b""),
            b"/health_generate": whole(200, b"application/json", b""),
            b"/v1/models": whole(
                200, b"application/json", _json({"object": "list", "data": [card]})
            ),
            b"/version": whole(200, b"application/json", _json({"version": "minimal-backend"})),
            b"/get_model_info": whole(200, b"application/json", _json(info)),
            b"/get_server_info": whole(200, b"application/json", _json(server)),
            b"/loads": whole(200, b"application/json", loads),
            b"/v1/loads": whole(200, b"application/json", loads),
        }

    def answer(self, method: bytes, url: bytes, body: bytes) -> bytes:
        """The whole HTTP response (status line to last byte) for one request."""
        path = url.split(b"?", 1)[0]
        if method == b"POST" and path in _KINDS:
            self.served += 1
            key = (path, body)
            cached = self.cache.get(key)
            if cached is None:
                self.built += 1
                cached = self._generate(_KINDS[path], body)
                if len(self.cache) >= _CACHE_LIMIT:
                    self.cache.clear()
                self.cache[key] = cached
            return cached
        if method == b"GET" and path in self.gets:
            return self.gets[path]
        if method == b"GET" and path == b"/metrics":
            text = _metrics(self.model, self.served, self.built, self.unknown)
            return whole(200, b"text/plain; version=0.0.4; charset=utf-8", text)
        if path in _KINDS or path in self.gets or path == b"/metrics":
            return error(405, f"method {method.decode()} is not allowed on {path.decode()}")
        self._note_unknown(method, path)
        return error(404, f"no route {method.decode()} {path.decode()}")

    def _note_unknown(self, method: bytes, path: bytes) -> None:
        """Count a request no route serves (the first ``_UNKNOWN_LIMIT`` paths, each
        logged once to stderr): a relay that probes something unexpected shows up."""
        seen = self.unknown.get(path)
        if seen is not None:
            self.unknown[path] = seen + 1
        elif len(self.unknown) < _UNKNOWN_LIMIT:
            self.unknown[path] = 1
            print(f"unknown request: {method.decode()} {path.decode()}", file=sys.stderr)

    def _generate(self, kind: Kind, raw: bytes) -> bytes:
        try:
            request = parse_for(kind, decode_json_object(raw))
        except RequestError as exc:
            return error(400, str(exc), exc.param)
        prompt = self._prompt_ids(request)
        if not prompt:
            return error(400, "The decoder prompt cannot be empty", "prompt")
        count = min(request.output_limit() or COMPLETION_TOKENS, COMPLETION_TOKENS)
        output = list(_OUTPUT_IDS[:count])
        usage = Usage(prompt_tokens=len(prompt), completion_tokens=count)
        model = request.model or self.model
        if request.stream:
            return chunked(self._events(kind, request, model, prompt, output, usage))
        body = completion_body(
            kind=kind,
            response_id=_response_id(kind),
            model=model,
            text=self.tokenizer.decode(output),
            finish_reason="length",
            usage=usage,
            token_ids=output if request.return_token_ids else None,
            prompt_token_ids=prompt if request.return_token_ids else None,
        )
        return whole(200, b"application/json", _json(body))

    def _prompt_ids(self, request: OpenAIRequest) -> list[int]:
        if isinstance(request, ChatCompletionRequest):
            return self.tokenizer.encode(render_chat(request.messages))
        if isinstance(request.prompt, str):
            return self.tokenizer.encode(request.prompt)
        return list(request.prompt)

    def _events(
        self,
        kind: Kind,
        request: OpenAIRequest,
        model: str,
        prompt: list[int],
        output: list[int],
        usage: Usage,
    ) -> list[bytes]:
        """The SSE events of a streamed answer, ``[DONE]`` included."""
        ids = request.return_token_ids
        response_id = _response_id(kind)
        created = int(time.time())

        def chunk(text: str | None, **fields: Any) -> bytes:
            return encode_event(
                stream_chunk(
                    kind=kind,
                    response_id=response_id,
                    model=model,
                    created=created,
                    text=text,
                    **fields,
                )
            )

        pending_prompt: list[int] | None = prompt if ids else None
        events = []
        if kind == "chat":
            events.append(chunk(None, role=True, prompt_token_ids=pending_prompt))
            pending_prompt = None
        for position, token in enumerate(output):
            last = position == len(output) - 1
            events.append(
                chunk(
                    self.tokenizer.token_text(token),
                    finish_reason="length" if last else None,
                    token_ids=[token] if ids else None,
                    prompt_token_ids=pending_prompt,
                )
            )
            pending_prompt = None
        if request.include_usage:
            events.append(
                encode_event(
                    usage_chunk(
                        kind=kind,
                        response_id=response_id,
                        model=model,
                        created=created,
                        usage=usage,
                    )
                )
            )
        events.append(DONE)
        return events


class _Connection(asyncio.Protocol):
    """One HTTP/1.1 connection: parse with httptools, answer from :class:`Answers`."""

    def __init__(self, answers: Answers) -> None:
        self.answers = answers
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.url = b""
        self.body: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            if self.transport is not None:
                self.transport.write(error(400, "malformed HTTP request"))
                self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None

    # httptools callbacks
    def on_message_begin(self) -> None:
        self.url = b""
        self.body = []

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        if self.transport is None:
            return
        method = self.parser.get_method()
        self.transport.write(self.answers.answer(method, self.url, b"".join(self.body)))
        if not self.parser.should_keep_alive():
            self.transport.close()


async def serve(host: str, port: int, model: str, announce: Callable[[str], None]) -> None:
    """Serve until SIGINT or SIGTERM; ``announce(url)`` once listening."""
    loop = asyncio.get_running_loop()
    answers = Answers(model)
    server = await loop.create_server(lambda: _Connection(answers), host, port, backlog=4096)
    bound = server.sockets[0].getsockname()[1]
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    announce(f"http://{host}:{bound}")
    async with server:
        await stop.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    parser.add_argument("--model", default=MODEL, help="the served model name")
    args = parser.parse_args(argv)
    uvloop.run(
        serve(args.host, args.port, args.model, lambda url: print(f"READY {url}", flush=True))
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
