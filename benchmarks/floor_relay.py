"""The Python floor of a relay: what relaying costs with nothing else to do.

Not a product: lower bounds for the overhead benchmark (``--targets
floor-asgi,floor-raw,floor-decode,floor-plan``) and ``request_path.py``. Every request
goes to one upstream through the gateway's own HTTP client
(:class:`pd_orchestrator.upstream.transport.HttpTransport`, keep-alive pooled). Four
modes:

* ``asgi``: uvicorn with httptools and uvloop, as the gateway serves (its own
  protocol class aside), and a twenty-line ASGI app that passes the request and
  the answer through byte for byte (no parse, no plan, no metrics): the floor of
  the gateway's stack, so the gateway's figure less this one is what its own work
  costs;
* ``raw``: the same pass-through on an ``asyncio.Protocol`` with httptools' request
  parser on uvloop, one task per request: the floor of any Python relay on this
  event loop, so this one less SMG's or vllm-router's is what Python itself costs;
* ``decode``: ``asgi`` plus the least a decode-first gateway must do to a request
  that its decoder serves: the body parsed (orjson) and validated (the gateway's
  own request model), the threshold and the token ids asked for, the leg's body
  encoded; the answer, or each streamed event, parsed, its finish reason read for
  ``cache_threshold`` (a whole answer declined is a 502 here, where a gateway would
  hand it over), its token ids taken out and encoded again; a request counter by
  outcome and a latency histogram (prometheus-client). What a lean path for the
  commonest request would cost at best;
* ``plan``: ``decode`` with the gateway's own decision in place of the parse and the
  fixed threshold: its admission (the body's limits, the request's parse, its facts),
  its planner's whole plan over the fleet (the overhead benchmark's config: the
  routing pipeline, the threshold policy) and its planner's learning from the
  answer's usage and TTFT. What a lean flow under today's plan would cost: the
  gateway's figure less this one is what its general flow costs on top.

Run as a script (prints ``READY http://127.0.0.1:PORT`` once listening)::

    python benchmarks/floor_relay.py --mode asgi --upstream http://127.0.0.1:8000 --port 0
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, cast

import httptools
import orjson
import uvicorn
import uvloop
from prometheus_client import CollectorRegistry, Counter, Histogram

from pd_orchestrator.config.settings import GatewayConfig
from pd_orchestrator.flows.sink import GatewayError
from pd_orchestrator.gateway.admission import Body, RequestIds, admit, header_map, json_object
from pd_orchestrator.gateway.app import Gateway
from pd_orchestrator.gateway.limits import check_json
from pd_orchestrator.gateway.state import GatewayState
from pd_orchestrator.model.load import Candidate
from pd_orchestrator.model.route import threshold_of
from pd_orchestrator.openai.errors import error_body
from pd_orchestrator.openai.protocol import RequestError, parse_for
from pd_orchestrator.planner.plan import Served as Taught
from pd_orchestrator.upstream.transport import (
    HttpTransport,
    Origin,
    Request,
    Response,
    Timeouts,
)

TIMEOUTS = Timeouts(connect=5.0, read=60.0, pool=5.0)
STREAM = "text/event-stream"
Scope = dict[str, Any]
Message = dict[str, Any]


class Upstream:
    """The one upstream every request goes to, through the gateway's HTTP client."""

    def __init__(self, url: str) -> None:
        self.origin = Origin.of(url)
        self.transport = HttpTransport()

    async def send(self, method: str, path: str, body: bytes) -> Response:
        return await self.transport.send(Request(method, self.origin, path, body), TIMEOUTS)


def _content_type(headers: list[tuple[str, str]]) -> str:
    for name, value in headers:
        if name == "content-type":
            return value
    return "application/json"


async def read_body(receive: Callable[[], Any]) -> bytes:
    """The request's whole body from its ASGI messages."""
    body, more = b"", True
    while more:
        message = await receive()
        body += message.get("body", b"")
        more = message.get("more_body", False)
    return body


async def send_whole(
    send: Callable[[Message], Any], status: int, data: bytes, kind: bytes = b"application/json"
) -> None:
    """A whole answer: its head with the length, then its body."""
    head = [(b"content-type", kind), (b"content-length", str(len(data)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": data})


# -- ASGI on uvicorn ---------------------------------------------------------------------
def asgi_app(upstream: Upstream) -> Callable[..., Any]:
    async def app(scope: Scope, receive: Callable[[], Any], send: Callable[[Message], Any]) -> None:
        if scope["type"] != "http":
            return
        body = await read_body(receive)
        response = await upstream.send(scope["method"], scope["path"], body)
        kind = _content_type(response.headers)
        if not kind.startswith(STREAM):
            await send_whole(send, response.status, await response.read(), kind.encode())
            return
        head = [(b"content-type", kind.encode())]
        await send({"type": "http.response.start", "status": response.status, "headers": head})
        async for piece in response:
            await send({"type": "http.response.body", "body": piece, "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    return app


async def serve_asgi(sock: socket.socket, app: Callable[..., Any]) -> None:
    """Serve ``app`` with uvicorn (httptools, on the running loop) on ``sock``."""
    config = uvicorn.Config(
        app, loop="none", http="httptools", lifespan="off",
        access_log=False, log_level="warning",
    )  # fmt: skip
    await uvicorn.Server(config).serve(sockets=[sock])


# -- the least a decode-first gateway does ------------------------------------------------
THRESHOLD = 0.7
_METRICS = CollectorRegistry()  # its own: the module may be loaded again in one process
REQUESTS = Counter("floor_requests", "Requests answered", ["decision"], registry=_METRICS)
LATENCY = Histogram("floor_request_seconds", "Seconds to the answer's end", registry=_METRICS)
_HIDDEN = ("token_ids", "prompt_token_ids")


def upstream_body(body: dict[str, Any], threshold: float = THRESHOLD) -> bytes:
    """The decoder's leg: the client's body with the threshold and the token ids."""
    leg = dict(body)
    leg["cache_hit_threshold"] = threshold
    leg["return_token_ids"] = True
    if leg.get("stream"):
        leg["stream_options"] = {"include_usage": True}
    return orjson.dumps(leg)


def reshape(answer: dict[str, Any]) -> bool:
    """Take the token ids out of ``answer`` in place; whether the decoder declined it."""
    declined = False
    for choice in answer.get("choices") or ():
        declined = declined or choice.get("finish_reason") == "cache_threshold"
        for name in _HIDDEN:
            choice.pop(name, None)
    return declined


DECLINED = b'{"error": {"message": "the decoder declined: cache_threshold", "code": 502}}'


class Refused(Exception):
    """A request refused before any leg: ``status`` and the error's JSON body."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(status)
        self.status = status
        self.body = body


@dataclass(slots=True)
class Served:
    """What the decoder's answer said, for learning: seconds to the first content, and
    the usage it reported (None: none)."""

    ttft: float | None = None
    usage: dict[str, Any] | None = None


class Decider(Protocol):
    """How a decoding floor decides a request: the client's body (raw) to the body to
    send on and its threshold, and a ticket that :meth:`learn` gets back."""

    def decide(self, scope: Scope, raw: bytes) -> tuple[dict[str, Any], float, Any]: ...

    def learn(self, ticket: Any, served: Served) -> None: ...


class Fixed:
    """``decode``'s decision: the body parsed and validated, a fixed threshold, nothing
    learnt."""

    def decide(self, scope: Scope, raw: bytes) -> tuple[dict[str, Any], float, Any]:
        try:
            body = orjson.loads(raw)
            parse_for("completion" if scope["path"] == "/v1/completions" else "chat", body)
        except (orjson.JSONDecodeError, RequestError) as exc:
            error = {"error": {"message": str(exc), "code": 400}}
            raise Refused(400, orjson.dumps(error)) from None
        return body, THRESHOLD, None

    def learn(self, ticket: Any, served: Served) -> None:
        return None


def decode_app(upstream: Upstream, decider: Decider | None = None) -> Callable[..., Any]:
    """The ``decode`` floor (``decider`` None: :class:`Fixed`), or any other way to
    decide the leg (``plan``: :class:`Planned`)."""
    decide = decider or Fixed()

    async def app(scope: Scope, receive: Callable[[], Any], send: Callable[[Message], Any]) -> None:
        if scope["type"] != "http":
            return
        started = time.monotonic()
        try:
            body, threshold, ticket = decide.decide(scope, await read_body(receive))
        except Refused as exc:
            await send_whole(send, exc.status, exc.body)
            return
        response = await upstream.send("POST", scope["path"], upstream_body(body, threshold))
        served = Served()
        if not body.get("stream"):
            answer = orjson.loads(await response.read())
            served.ttft, served.usage = time.monotonic() - started, answer.get("usage")
            if reshape(answer):
                await send_whole(send, 502, DECLINED)
                return
            await send_whole(send, response.status, orjson.dumps(answer))
        else:
            head = [(b"content-type", STREAM.encode())]
            await send({"type": "http.response.start", "status": response.status, "headers": head})
            rest, declined = b"", False
            usage = bool(body.get("stream_options"))  # the client asked for the usage chunk
            async for piece in response:
                events = (rest + piece).split(b"\n\n")
                rest = events.pop()
                out = []
                for event in events:
                    data = event[6:]
                    if data == b"[DONE]":
                        out.append(b"data: [DONE]\n\n")
                        continue
                    chunk = orjson.loads(data)
                    declined = reshape(chunk) or declined
                    choices = chunk.get("choices")
                    if not choices:
                        served.usage = chunk.get("usage")
                    elif served.ttft is None:
                        served.ttft = time.monotonic() - started
                    if choices or usage:
                        out.append(b"data: " + orjson.dumps(chunk) + b"\n\n")
                if out:
                    await send({"type": "http.response.body", "body": b"".join(out),
                                "more_body": True})  # fmt: skip
            await send({"type": "http.response.body", "body": b""})
            if declined:  # a gateway would hand the stream over here
                REQUESTS.labels("declined").inc()
                return
        REQUESTS.labels("decode").inc()
        LATENCY.observe(time.monotonic() - started)
        decide.learn(ticket, served)

    return app


def _candidates(state: GatewayState, now: float) -> tuple[Candidate, ...]:
    """The routing candidates as the gateway reads them (kept current); made afresh
    from the fleet's snapshot on a checkout from before they were kept (``--baseline``
    of ``instructions.py`` runs these scripts against one)."""
    current = getattr(state.scraper, "current", None)
    if current is None:
        return state.scraper.candidates(state.fleet.snapshot(), now)
    return cast(tuple[Candidate, ...], current(now))


class Planned:
    """``plan``'s decision: the gateway's own admission (the body's checks, the
    request's parse and facts), its planner's whole plan over the fleet of ``config``
    (routing pipeline, threshold policy), and its planner's learning from the answer,
    as the gateway does them; the leg goes to the one upstream whichever decoder the
    plan named (in the overhead benchmark's config every endpoint is that upstream)."""

    def __init__(self, config: GatewayConfig) -> None:
        self.state = Gateway(config).state
        self.ids = RequestIds()
        self.ordinals = itertools.count()

    def decide(self, scope: Scope, raw: bytes) -> tuple[dict[str, Any], float, Any]:
        state, path = self.state, scope["path"]
        kind = "completion" if path == "/v1/completions" else "chat"
        try:
            body = json_object(raw)
            check_json(body, state.config.limits, kind)
            now = time.monotonic()
            headers = header_map(scope["headers"])
            admitted = admit(state, kind, path, Body(raw, body), headers, now, self.ids)
            candidates = _candidates(state, now)
            plan = state.planner.plan(admitted.facts, candidates, now, next(self.ordinals))
        except GatewayError as exc:
            error = error_body(exc.message, exc.status, param=exc.param)
            raise Refused(exc.status, orjson.dumps(error)) from None
        return admitted.request.body, threshold_of(plan.route), (admitted, plan)

    def learn(self, ticket: Any, served: Served) -> None:
        admitted, plan = ticket
        usage = served.usage or {}
        details = usage.get("prompt_tokens_details") or {}
        cached = self.state.cache_reports.resolve(plan.decoder.name, details.get("cached_tokens"))
        taught = Taught(
            plan.decoder, time.monotonic(), served.ttft, None, usage.get("prompt_tokens"),
            cached_tokens=cached, output_tokens=usage.get("completion_tokens") or 0, remote=False,
        )  # fmt: skip
        self.state.planner.learn(plan, admitted.facts, taught)


# -- a raw asyncio protocol --------------------------------------------------------------
_RUNNING: set[asyncio.Future[None]] = set()


class _Relay(asyncio.Protocol):
    """One client connection: requests parsed by httptools, each relayed by a task."""

    def __init__(self, upstream: Upstream) -> None:
        self.upstream = upstream
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.url = b""
        self.body: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            if self.transport is not None:
                self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None

    def on_message_begin(self) -> None:
        self.url, self.body = b"", []

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        method = self.parser.get_method().decode()
        keep = self.parser.should_keep_alive()
        path = httptools.parse_url(self.url).path.decode()
        task = asyncio.ensure_future(self.relay(method, path, b"".join(self.body), keep))
        _RUNNING.add(task)  # a task the loop alone holds may be collected mid-request
        task.add_done_callback(_RUNNING.discard)

    async def relay(self, method: str, path: str, body: bytes, keep: bool) -> None:
        response = await self.upstream.send(method, path, body)
        kind = _content_type(response.headers)
        head = f"HTTP/1.1 {response.status} OK\r\ncontent-type: {kind}\r\n"
        if not kind.startswith(STREAM):
            data = await response.read()
            self._write(f"{head}content-length: {len(data)}\r\n\r\n".encode() + data)
        else:
            self._write(f"{head}transfer-encoding: chunked\r\n\r\n".encode())
            async for piece in response:
                self._write(b"%x\r\n%s\r\n" % (len(piece), piece))
            self._write(b"0\r\n\r\n")
        if not keep and self.transport is not None:
            self.transport.close()

    def _write(self, data: bytes) -> None:
        if self.transport is not None:
            self.transport.write(data)


async def serve_raw(sock: socket.socket, upstream: Upstream) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Relay(upstream), sock=sock, backlog=4096)
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with server:
        await stop.wait()


def app_of(mode: str, upstream: Upstream, url: str, model: str | None = None) -> Callable[..., Any]:
    """The ASGI app of ``mode`` (``asgi``, ``decode`` or ``plan``) relaying to
    ``upstream`` (at ``url``: ``plan``'s fleet is the overhead benchmark's config of it,
    serving ``model``, by default the benchmark's)."""
    if mode == "asgi":
        return asgi_app(upstream)
    if mode == "decode":
        return decode_app(upstream)
    import overhead_bench

    from pd_orchestrator.config.loader import parse_config

    config = overhead_bench.gateway_config(url, model or overhead_bench.MODEL)
    return decode_app(upstream, Planned(parse_config(config)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--mode", choices=("asgi", "raw", "decode", "plan"), required=True)
    parser.add_argument("--upstream", required=True, help="the backend's base URL")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--model", help="plan: the model the fleet serves (the benchmark's)")
    args = parser.parse_args(argv)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    sock.listen(4096)
    print(f"READY http://{args.host}:{sock.getsockname()[1]}", flush=True)
    upstream = Upstream(args.upstream)
    if args.mode == "raw":
        uvloop.run(serve_raw(sock, upstream))
    else:
        uvloop.run(serve_asgi(sock, app_of(args.mode, upstream, args.upstream, args.model)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
