"""The gateway's HTTP client towards vLLM instances: the one module for upstream I/O.

:class:`Upstream` sends JSON bodies (encoded once, with orjson) through one
:class:`~pd_orchestrator.upstream.transport.Transport` and decodes what comes back:
a whole JSON answer (:meth:`Upstream.post_json`), an SSE stream read as batches of
JSON chunks (:meth:`Upstream.open_stream`: one batch per network read, so a relay
can answer a burst of chunks with one write) or a plain reply for health and
metrics polls (:meth:`Upstream.get`). Every call names its phase, which picks the
read timeout, and the size of the prompt it carries, which lengthens it
(``timeouts.per_1k_prompt_tokens``: :meth:`Upstream.allowance`). Transport errors
never leave this module: :class:`_Translate` turns them into
:mod:`~pd_orchestrator.upstream.errors`. Streams must be closed with
:meth:`ChunkStream.aclose`; closing one before its end closes its connection,
which is how vLLM learns to abort the request.
"""

from __future__ import annotations

import enum
import math
import socket
import time
from collections.abc import Mapping
from dataclasses import replace
from typing import Any
from urllib.parse import urlsplit

import anyio
import orjson

from pd_orchestrator.config.settings import TimeoutConfig, UpstreamConfig
from pd_orchestrator.model.endpoints import Endpoint
from pd_orchestrator.model.records import record
from pd_orchestrator.openai.errors import error_message
from pd_orchestrator.upstream.errors import (
    GatewayResourceError,
    UpstreamProtocolError,
    UpstreamStatusError,
    UpstreamTimeout,
    UpstreamUnavailable,
)
from pd_orchestrator.upstream.transport import (
    ConnectFailed,
    ConnectionBroken,
    HttpTransport,
    Origin,
    OutOfResources,
    PoolTimedOut,
    ReadTimedOut,
    Request,
    Response,
    Timeouts,
    Transport,
    TransportError,
)

__all__ = ["ChunkStream", "Phase", "Reply", "Upstream", "role_label"]

Json = dict[str, Any]


class Phase(enum.StrEnum):
    DECODE_ATTEMPT = "decode_attempt"
    PREFILL = "prefill"
    DECODE = "decode"
    PROBE = "probe"
    TOKENIZE = "tokenize"


def role_label(endpoint: Endpoint) -> str:
    """``decoder`` or ``prefiller``: how messages name an endpoint's part."""
    return "decoder" if endpoint.role.value == "decode" else "prefiller"


class _Translate:
    """Within it, a transport failure becomes the :class:`UpstreamError` of ``endpoint``
    in ``phase`` (chained to it); anything else passes. A plain context manager (no
    generator per use); it holds no state of a use, so one instance serves many."""

    __slots__ = ("endpoint", "phase")

    def __init__(self, endpoint: Endpoint, phase: Phase) -> None:
        self.endpoint = endpoint
        self.phase = phase

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: object
    ) -> None:
        if exc is None or not isinstance(exc, TransportError):
            return
        endpoint, phase = self.endpoint, self.phase
        role = role_label(endpoint)
        if isinstance(exc, OutOfResources):
            raise GatewayResourceError(
                endpoint.name, phase, str(exc), role=role, resource=exc.resource
            ) from exc
        if isinstance(exc, ConnectFailed):
            raise UpstreamUnavailable(endpoint.name, phase, str(exc), role=role) from exc
        if isinstance(exc, (ReadTimedOut, PoolTimedOut)):
            raise UpstreamTimeout(endpoint.name, phase, type(exc).__name__, role=role) from exc
        if isinstance(exc, ConnectionBroken):
            message = f"connection broken ({exc})"
            raise UpstreamProtocolError(endpoint.name, phase, message, role=role) from exc
        raise UpstreamProtocolError(endpoint.name, phase, str(exc), role=role) from exc


@record
class Reply:
    """A status and body of a GET (health checks, metrics polls)."""

    status_code: int
    content: bytes

    @property
    def text(self) -> str:
        return self.content.decode(errors="replace")


class _LineTooLong(Exception):
    """An event longer than the splitter's limit (the upstream's protocol error)."""


class _SseSplitter:
    """Cuts a byte stream into the ``data`` payloads of server-sent events, none
    longer than ``limit`` bytes (:class:`_LineTooLong`: nothing longer is kept)."""

    def __init__(self, limit: int) -> None:
        self._tail = b""
        self.limit = limit

    def feed(self, piece: bytes) -> list[bytes]:
        data = self._tail + piece if self._tail else piece
        if b"\r" in data:
            carry = data.endswith(b"\r")
            data = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
            if carry:  # a CR that may pair with the next piece's LF stays pending
                data = data[:-1] + b"\r"
        events = data.split(b"\n\n")
        self._tail = events.pop()
        if len(data) > self.limit and max(map(len, (self._tail, *events))) > self.limit:
            self._tail = b""
            raise _LineTooLong
        payloads: list[bytes] = []
        for event in events:
            if event.startswith(b"data: ") and b"\n" not in event:  # the common event
                payloads.append(event[6:])
            elif (payload := _payload(event)) is not None:
                payloads.append(payload)
        return payloads

    def rest(self) -> bytes | None:
        """The payload of a last event not followed by a blank line, if any."""
        tail, self._tail = self._tail.rstrip(b"\r\n"), b""
        return _payload(tail) if tail else None


def _payload(event: bytes) -> bytes | None:
    if event.startswith(b"data: ") and b"\n" not in event:
        return event[6:]
    lines = [line for line in event.split(b"\n") if line.startswith(b"data:")]
    if not lines:
        return None  # comments and other fields
    return b"\n".join(line[6:] if line.startswith(b"data: ") else line[5:] for line in lines)


class ChunkStream:
    """The JSON chunks of one upstream SSE stream, in batches, until ``[DONE]``.

    ``async for batch in stream`` yields the chunks that one network read completed
    (never an empty batch). An ``error`` chunk raises :class:`UpstreamStatusError`;
    a stream that ends without ``[DONE]``, or an event longer than ``max_line``
    bytes, raises :class:`UpstreamProtocolError`.
    """

    def __init__(
        self, response: Response, endpoint: Endpoint, phase: Phase, max_line: int = 16 << 20
    ) -> None:
        self.endpoint = endpoint
        self.phase = phase
        self._response = response
        self._pieces = response.__aiter__()
        self._splitter = _SseSplitter(max_line)
        self._translated = _Translate(endpoint, phase)
        self._done = False
        self._drained = False

    def __aiter__(self) -> ChunkStream:
        return self

    @property
    def done(self) -> bool:
        """Whether ``[DONE]`` was read (closing is then only a release, no I/O)."""
        return self._done

    async def __anext__(self) -> list[Json]:
        while not self._done:
            with self._translated:
                try:
                    piece = await self._pieces.__anext__()
                except StopAsyncIteration:
                    piece = None
            try:
                payloads = self._splitter.feed(piece) if piece is not None else []
            except _LineTooLong:
                raise self._error(f"an event exceeds {self._splitter.limit} bytes") from None
            if piece is None:
                rest = self._splitter.rest()
                if rest is None:
                    raise self._error("stream ended without [DONE]")
                payloads.append(rest)
            batch = self._decode(payloads)
            if batch:
                return batch
        if not self._drained:  # read the answer's last bytes: its connection is reused
            self._drained = True
            with self._translated:
                async for _ in self._pieces:
                    pass
        raise StopAsyncIteration

    def _decode(self, payloads: list[bytes]) -> list[Json]:
        """The chunks of ``payloads`` up to ``[DONE]``; a chunk that is no object, or
        says an error, goes to :meth:`_checked` (read here: one check per chunk)."""
        batch: list[Json] = []
        for payload in payloads:
            if payload == b"[DONE]":
                self._done = True
                break
            try:
                chunk = orjson.loads(payload)
            except orjson.JSONDecodeError as exc:
                raise self._error("invalid JSON chunk") from exc
            if not isinstance(chunk, dict) or "error" in chunk or chunk.get("object") == "error":
                chunk = self._checked(chunk)
            batch.append(chunk)
        return batch

    def _checked(self, chunk: object) -> Json:
        """A chunk that is no object (a protocol error), or one that says an error
        (raised as the upstream's status when it carries a message; else relayed)."""
        if not isinstance(chunk, dict):
            raise self._error("chunk is not an object")
        message = error_message(chunk)
        if message is not None:
            inner = chunk.get("error")
            code = inner.get("code") if isinstance(inner, dict) else chunk.get("code")
            status = code if isinstance(code, int) and 400 <= code < 600 else 500
            raise UpstreamStatusError(
                self.endpoint.name, self.phase, status, message, role=role_label(self.endpoint)
            )
        return chunk

    def _error(self, message: str) -> UpstreamProtocolError:
        return UpstreamProtocolError(
            self.endpoint.name, self.phase, message, role=role_label(self.endpoint)
        )

    async def aclose(self) -> None:
        """Close the connection unless the stream was read to its end."""
        await self._response.aclose()


_MAX_TARGETS = 4096
"""Endpoint URLs whose parsed origin is kept (a cache: cleared when full)."""

_RESOLVE_EVERY = 30.0
"""Seconds a resolved endpoint name is trusted (:meth:`Upstream.addresses`)."""


class Upstream:
    """All requests to endpoints go through here."""

    def __init__(
        self,
        config: UpstreamConfig,
        timeouts: TimeoutConfig,
        transport: Transport | None = None,
    ) -> None:
        self.timeouts = timeouts
        self._max_line = config.max_line_bytes
        self._transport: Transport = transport or HttpTransport(
            max_connections=config.max_connections,
            max_keepalive=config.max_keepalive_connections,
            expiry=config.keepalive_expiry,
        )
        self._targets: dict[str, tuple[Origin, str]] = {}
        self._timeouts = {phase: self._timeout(phase) for phase in Phase}
        self._grown: dict[tuple[Phase, int], Timeouts] = {}
        self._resolutions: dict[str, tuple[float, frozenset[str]]] = {}

    async def aclose(self) -> None:
        await self._transport.aclose()

    def _timeout(self, phase: Phase) -> Timeouts:
        t = self.timeouts
        read = {
            Phase.DECODE_ATTEMPT: t.decode_attempt,
            Phase.PREFILL: t.prefill,
            Phase.DECODE: t.decode,
            Phase.PROBE: t.connect,
            Phase.TOKENIZE: t.decode_attempt,
        }[phase]
        return Timeouts(connect=t.connect, read=read, pool=t.pool)

    def allowance(self, prompt_tokens: int) -> float:
        """Seconds a leg's read timeout grows by for a prompt of ``prompt_tokens`` tokens:
        prefilling it (or recomputing it after a preemption) takes that much longer."""
        return self.timeouts.per_1k_prompt_tokens * prompt_tokens / 1000.0

    @staticmethod
    def hosts_of(endpoint: Endpoint) -> frozenset[str]:
        """The hosts the configuration names for ``endpoint``: its URL's and its ``kv``
        host (no I/O)."""
        names = {endpoint.peer.host.lower(), (urlsplit(endpoint.url).hostname or "").lower()}
        return frozenset(names - {""})

    async def addresses(self, endpoint: Endpoint) -> frozenset[str]:
        """The hosts ``endpoint`` may be reached at: :meth:`hosts_of` and the addresses
        those names resolve to (resolved at most every :data:`_RESOLVE_EVERY` seconds;
        an unresolvable name counts as itself only). What a prefiller's transfer params
        may name (:mod:`pd_orchestrator.flows.handover`)."""
        names = self.hosts_of(endpoint)
        found = set(names)
        for name in names:
            found |= await self._resolved(name)
        return frozenset(found)

    async def _resolved(self, name: str) -> frozenset[str]:
        now = time.monotonic()
        cached = self._resolutions.get(name)
        if cached is not None and now - cached[0] < _RESOLVE_EVERY:
            return cached[1]
        try:
            infos = await anyio.getaddrinfo(name, None, type=socket.SOCK_STREAM)
        except OSError:
            addresses: frozenset[str] = frozenset()
        else:
            addresses = frozenset(str(info[4][0]).lower() for info in infos)
        if len(self._resolutions) >= _MAX_TARGETS:
            self._resolutions.clear()
        self._resolutions[name] = (now, addresses)
        return addresses

    def _timeouts_for(self, phase: Phase, prompt_tokens: int) -> Timeouts:
        """The phase's timeouts, the read timeout grown by :meth:`allowance` rounded up
        to a whole second (so a handful of variants serve every prompt)."""
        extra = math.ceil(self.allowance(prompt_tokens))
        if extra <= 0:
            return self._timeouts[phase]
        key = (phase, extra)
        found = self._grown.get(key)
        if found is None:
            if len(self._grown) >= 1024:
                self._grown.clear()
            timeouts = self._timeouts[phase]
            found = self._grown[key] = replace(timeouts, read=timeouts.read + extra)
        return found

    def _request(
        self,
        endpoint: Endpoint,
        method: str,
        path: str,
        content: bytes | tuple[bytes, ...],
        headers: Any,
    ) -> Request:
        target = self._targets.get(endpoint.url)
        if target is None:
            if len(self._targets) >= _MAX_TARGETS:
                self._targets.clear()  # sidecar targets come and go: stay bounded
            base = endpoint.url.split("://", 1)[-1]
            prefix = base[base.index("/") :] if "/" in base else ""
            target = self._targets[endpoint.url] = (Origin.of(endpoint.url), prefix)
        origin, prefix = target
        lines = tuple(headers.items()) if headers else ()
        return Request(method, origin, prefix + path, content, lines)

    async def _exchange(
        self, endpoint: Endpoint, request: Request, phase: Phase, timeouts: Timeouts
    ) -> Reply:
        """The one send path of a whole answer: send, read it all, close; transport
        failures become :class:`UpstreamError` (any status is returned)."""
        with _Translate(endpoint, phase):
            response = await self._transport.send(request, timeouts)
            return Reply(response.status, await self._read_all(response, endpoint, phase))

    async def post_json(
        self,
        endpoint: Endpoint,
        path: str,
        body: Json | tuple[bytes, ...],
        *,
        phase: Phase,
        headers: Mapping[str, str] | None = None,
        prompt_tokens: int = 0,
    ) -> Json:
        """POST ``body`` (its prompt ``prompt_tokens`` long) and return the decoded JSON
        answer (2xx only)."""
        request = self._request(endpoint, "POST", path, _content(body), headers)
        reply = await self._exchange(
            endpoint, request, phase, self._timeouts_for(phase, prompt_tokens)
        )
        data = _decoded(endpoint, phase, reply, "answer")
        if not isinstance(data, dict):
            raise UpstreamProtocolError(
                endpoint.name, phase, "answer is not an object", role=role_label(endpoint)
            )
        return data

    async def open_stream(
        self,
        endpoint: Endpoint,
        path: str,
        body: Json | tuple[bytes, ...],
        *,
        phase: Phase,
        headers: Mapping[str, str] | None = None,
        prompt_tokens: int = 0,
    ) -> ChunkStream:
        """POST ``body`` (its prompt ``prompt_tokens`` long) for an SSE answer; the caller
        must ``aclose`` the stream."""
        request = self._request(endpoint, "POST", path, _content(body), headers)
        timeouts = self._timeouts_for(phase, prompt_tokens)
        with _Translate(endpoint, phase):
            response = await self._transport.send(request, timeouts)
            if response.status < 300:
                return ChunkStream(response, endpoint, phase, self._max_line)
            content = await self._read_all(response, endpoint, phase)
        raise _status_error(endpoint, phase, response.status, content)

    async def _read_all(self, response: Response, endpoint: Endpoint, phase: Phase) -> bytes:
        """The whole body of ``response``, which is closed whatever happens; a body
        longer than ``upstream.max_line_bytes`` is the endpoint's protocol error."""
        pieces: list[bytes] = []
        size = 0
        try:
            async for piece in response:
                size += len(piece)
                if size > self._max_line:
                    message = f"the answer exceeds {self._max_line} bytes"
                    raise UpstreamProtocolError(
                        endpoint.name, phase, message, role=role_label(endpoint)
                    )
                pieces.append(piece)
        except BaseException:  # no awaiting `finally` in a compiled module (setup.py)
            await response.aclose()
            raise
        await response.aclose()
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)

    async def get_json(self, endpoint: Endpoint, url: str) -> Any:
        """``GET url`` (a connector's side channel of ``endpoint``, from its config) and
        its decoded JSON answer; bounded by the connect timeout for every step."""
        t = self.timeouts
        path = url.split("://", 1)[-1]
        path = path[path.index("/") :] if "/" in path else "/"
        request = Request("GET", Origin.of(url), path)
        timeouts = Timeouts(connect=t.connect, read=t.connect, pool=t.pool)
        reply = await self._exchange(endpoint, request, Phase.PROBE, timeouts)
        return _decoded(endpoint, Phase.PROBE, reply, "lookup answer")

    async def served_model(
        self, endpoint: Endpoint, *, limit: float
    ) -> tuple[str | None, int | None]:
        """The first model ``endpoint``'s ``/v1/models`` lists and its ``max_model_len``
        (None where it names none or says none, or answers another status than 200);
        bounded by ``limit`` seconds. Failures raise :class:`UpstreamError`."""
        reply = await self.get(endpoint, "/v1/models", limit=limit)
        listed: Any = orjson.loads(reply.content) if reply.status_code == 200 else {}
        models = listed.get("data") if isinstance(listed, dict) else None
        first = models[0] if isinstance(models, list) and models else None
        if not isinstance(first, dict):
            return None, None
        name, length = first.get("id"), first.get("max_model_len")
        return (
            name if isinstance(name, str) else None,
            length if isinstance(length, int) else None,
        )

    async def get(self, endpoint: Endpoint, path: str, *, limit: float) -> Reply:
        """A GET for health and metrics, bounded by ``limit`` seconds (any status is
        returned). Failures raise :class:`UpstreamError`."""
        t = self.timeouts
        timeouts = Timeouts(connect=min(t.connect, limit), read=limit, pool=min(t.pool, limit))
        request = self._request(endpoint, "GET", path, b"", None)
        return await self._exchange(endpoint, request, Phase.PROBE, timeouts)


def _content(body: Json | tuple[bytes, ...]) -> bytes | tuple[bytes, ...]:
    """A request's content: ``body`` encoded, or as the caller encoded it in pieces."""
    return body if isinstance(body, tuple) else orjson.dumps(body)


def _decoded(endpoint: Endpoint, phase: Phase, reply: Reply, what: str) -> Any:
    """The JSON of a 2xx ``reply``: a status >= 300 is :class:`UpstreamStatusError`, a
    body that is not JSON :class:`UpstreamProtocolError` (``what`` names it)."""
    _check_status(endpoint, phase, reply.status_code, reply.content)
    try:
        return orjson.loads(reply.content)
    except orjson.JSONDecodeError as exc:
        raise UpstreamProtocolError(
            endpoint.name, phase, f"{what} is not JSON", role=role_label(endpoint)
        ) from exc


def _check_status(endpoint: Endpoint, phase: Phase, status: int, content: bytes) -> None:
    """Nothing for a status below 300; else :func:`_status_error`."""
    if status >= 300:
        raise _status_error(endpoint, phase, status, content)


def _status_error(
    endpoint: Endpoint, phase: Phase, status: int, content: bytes
) -> UpstreamStatusError:
    """The error of a status >= 300, with the upstream's message (for the log: the
    client never sees it)."""
    try:
        message = error_message(orjson.loads(content)) or content.decode(errors="replace")
    except orjson.JSONDecodeError:
        message = content.decode(errors="replace")
    return UpstreamStatusError(
        endpoint.name, phase, status, message.strip()[:500] or "(empty)", role=role_label(endpoint)
    )
