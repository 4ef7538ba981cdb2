"""The gateway's HTTP client towards vLLM instances.

One :class:`Upstream` owns every connection: a few ``httpx.AsyncClient`` pools
("shards", ``upstream.pool_shards``) that share the connection limits, used in
turn. httpcore's pool checks each of its idle connections with a system call on
every request, so one pool's cost per request grows with its size; measured here,
one pool of 64 busy connections spent most of the gateway's CPU in those checks,
16 shards of 4 do not. Every call names its phase, which picks the read timeout.
httpx exceptions never leave this module: :func:`_translate` turns them into
:mod:`~pd_orchestrator.upstream.errors`.
Streams are opened with ``send(stream=True)`` and closed with :meth:`ChunkStream.aclose`
(closing the connection is how vLLM learns to abort the request).
"""

from __future__ import annotations

import enum
import itertools
import json
from collections.abc import AsyncGenerator, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import httpx

from pd_orchestrator.config.settings import TimeoutConfig, UpstreamConfig
from pd_orchestrator.fleet.endpoints import Endpoint
from pd_orchestrator.openai.errors import error_message
from pd_orchestrator.openai.sse import iter_sse_data
from pd_orchestrator.upstream.errors import (
    UpstreamProtocolError,
    UpstreamStatusError,
    UpstreamTimeout,
    UpstreamUnavailable,
)

__all__ = ["ChunkStream", "Phase", "Upstream"]

Json = dict[str, Any]


class Phase(enum.StrEnum):
    DECODE_ATTEMPT = "decode_attempt"
    PREFILL = "prefill"
    DECODE = "decode"
    PROBE = "probe"


def _role_label(endpoint: Endpoint) -> str:
    return "decoder" if endpoint.role.value == "decode" else "prefiller"


@contextmanager
def _translate(endpoint: Endpoint, phase: Phase) -> Iterator[None]:
    role = _role_label(endpoint)
    try:
        yield
    except httpx.TimeoutException as exc:
        kind = type(exc).__name__
        if isinstance(exc, httpx.ConnectTimeout):
            raise UpstreamUnavailable(endpoint.name, phase, kind, role=role) from exc
        raise UpstreamTimeout(endpoint.name, phase, kind, role=role) from exc
    except httpx.ConnectError as exc:
        raise UpstreamUnavailable(endpoint.name, phase, "connection refused", role=role) from exc
    except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as exc:
        message = f"connection broken ({type(exc).__name__})"
        raise UpstreamProtocolError(endpoint.name, phase, message, role=role) from exc
    except httpx.HTTPError as exc:
        raise UpstreamProtocolError(endpoint.name, phase, str(exc), role=role) from exc


class ChunkStream:
    """The JSON chunks of one upstream SSE stream, until ``[DONE]``."""

    def __init__(self, response: httpx.Response, endpoint: Endpoint, phase: Phase) -> None:
        self.response = response
        self.endpoint = endpoint
        self.phase = phase
        self._events = iter_sse_data(response.aiter_lines())
        self._chunk_iter = self._chunks()

    def __aiter__(self) -> ChunkStream:
        return self

    async def __anext__(self) -> Json:
        return await self._chunk_iter.__anext__()

    async def _chunks(self) -> AsyncGenerator[Json, None]:
        with _translate(self.endpoint, self.phase):
            async for data in self._events:
                if data == "[DONE]":
                    return
                yield self._decode(data)
        raise UpstreamProtocolError(
            self.endpoint.name,
            self.phase,
            "stream ended without [DONE]",
            role=_role_label(self.endpoint),
        )

    def _decode(self, data: str) -> Json:
        role = _role_label(self.endpoint)
        try:
            chunk = json.loads(data)
        except json.JSONDecodeError as exc:
            raise UpstreamProtocolError(
                self.endpoint.name, self.phase, "invalid JSON chunk", role=role
            ) from exc
        if not isinstance(chunk, dict):
            raise UpstreamProtocolError(
                self.endpoint.name, self.phase, "chunk is not an object", role=role
            )
        message = error_message(chunk)
        if message is not None:
            status = (
                chunk.get("error", {}).get("code") if isinstance(chunk.get("error"), dict) else None
            )
            raise UpstreamStatusError(
                self.endpoint.name, self.phase, int(status or 500), message, role=role
            )
        return chunk

    async def aclose(self) -> None:
        """Close the connection (vLLM aborts the request when it sees it go)."""
        await self._chunk_iter.aclose()
        await self.response.aclose()


class Upstream:
    """All requests to endpoints go through here."""

    def __init__(
        self,
        config: UpstreamConfig,
        timeouts: TimeoutConfig,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.timeouts = timeouts
        shards = config.pool_shards
        limits = httpx.Limits(
            max_connections=max(1, -(-config.max_connections // shards)),
            max_keepalive_connections=-(-config.max_keepalive_connections // shards),
        )
        self._clients = [
            httpx.AsyncClient(limits=limits, transport=transport, trust_env=False)
            for _ in range(shards)
        ]
        self._turn = itertools.cycle(self._clients)

    @property
    def _client(self) -> httpx.AsyncClient:
        return next(self._turn)

    async def aclose(self) -> None:
        for client in self._clients:
            await client.aclose()

    def _timeout(self, phase: Phase) -> httpx.Timeout:
        t = self.timeouts
        read = {
            Phase.DECODE_ATTEMPT: t.decode_attempt,
            Phase.PREFILL: t.prefill,
            Phase.DECODE: t.decode,
            Phase.PROBE: t.connect,
        }[phase]
        return httpx.Timeout(connect=t.connect, read=read, write=read, pool=t.pool)

    async def post_json(
        self,
        endpoint: Endpoint,
        path: str,
        body: Json,
        *,
        phase: Phase,
        headers: Mapping[str, str] | None = None,
    ) -> Json:
        """POST ``body`` and return the decoded JSON answer (2xx only)."""
        with _translate(endpoint, phase):
            response = await self._client.post(
                endpoint.url + path, json=body, headers=headers, timeout=self._timeout(phase)
            )
        self._check_status(endpoint, phase, response.status_code, response.content)
        try:
            data = response.json()
        except ValueError as exc:
            raise UpstreamProtocolError(
                endpoint.name, phase, "answer is not JSON", role=_role_label(endpoint)
            ) from exc
        if not isinstance(data, dict):
            raise UpstreamProtocolError(
                endpoint.name, phase, "answer is not an object", role=_role_label(endpoint)
            )
        return data

    async def open_stream(
        self,
        endpoint: Endpoint,
        path: str,
        body: Json,
        *,
        phase: Phase,
        headers: Mapping[str, str] | None = None,
    ) -> ChunkStream:
        """POST ``body`` for an SSE answer; the caller must ``aclose`` the stream."""
        client = self._client
        request = client.build_request(
            "POST", endpoint.url + path, json=body, headers=headers, timeout=self._timeout(phase)
        )
        with _translate(endpoint, phase):
            response = await client.send(request, stream=True)
        if response.status_code >= 300:
            try:
                with _translate(endpoint, phase):
                    content = await response.aread()
            finally:
                await response.aclose()
            self._check_status(endpoint, phase, response.status_code, content)
        return ChunkStream(response, endpoint, phase)

    async def get(self, endpoint: Endpoint, path: str, *, limit: float) -> httpx.Response:
        """A GET for health and metrics, bounded by ``limit`` seconds.

        Failures raise :class:`UpstreamError`.
        """
        with _translate(endpoint, Phase.PROBE):
            return await self._client.get(endpoint.url + path, timeout=limit)

    @staticmethod
    def _check_status(endpoint: Endpoint, phase: Phase, status: int, content: bytes) -> None:
        if status < 300:
            return
        try:
            message = error_message(json.loads(content)) or content.decode(errors="replace")
        except ValueError:
            message = content.decode(errors="replace")[:500]
        raise UpstreamStatusError(
            endpoint.name, phase, status, message.strip() or "(empty)", role=_role_label(endpoint)
        )
