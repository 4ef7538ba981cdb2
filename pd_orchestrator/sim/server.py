"""HTTP front of a simulated vLLM instance (vLLM's OpenAI server surface).

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (JSON or SSE),
``GET /v1/models``, ``GET /health``, ``GET /metrics``, ``GET /version``,
``POST /tokenize``, ``POST /detokenize``, ``POST /reset_prefix_cache`` and the KV
side channels of the ``--kv-connector`` it speaks (:mod:`pd_orchestrator.sim.handover`):
``POST /nixl/pull``, ``POST /nixl/push``, ``GET /query`` and ``POST /mooncake/pull``
(Mooncake's bootstrap server and worker), ``POST /moriio/notify``,
``POST /p2p/fetch`` and ``POST /p2p/lookup``. With ``--kv-events-endpoint`` the
instance publishes its KV-cache events over ZMQ in vLLM's wire format
(:mod:`pd_orchestrator.sim.kv_events`).

Test hooks (as llm-d's inference simulator has them):

* ``X-Return-Error: <status>`` answers that error at once;
* ``X-Cache-Threshold-Finish-Reason: true`` forces a ``cache_threshold`` rejection;
* ``X-Drop-After-Tokens: <n>`` (or ``--drop-after-tokens``) drops a stream's
  connection after ``n`` tokens;
* ``--failure-rate`` answers a seeded random fraction of requests with 500;
* ``--response-delay`` holds each completion request that long before taking it,
  ``--health-delay`` each ``/health`` answer (a slow or busy server);
* ``--lease-seconds 0``: produced KV expires before a consumer can pull it;
* ``--always-reject`` answers every request ``cache_threshold``, even at threshold 0,
  and ``--protocol-fault`` sends answers no vLLM would (:mod:`pd_orchestrator.sim.faults`).
"""

from __future__ import annotations

import contextlib
import logging
import random
import secrets
import socket
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
import httpx
import uvicorn
from anyio.streams.memory import MemoryObjectReceiveStream
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from pd_orchestrator import __version__
from pd_orchestrator.openai.errors import error_body
from pd_orchestrator.openai.protocol import (
    ChatCompletionRequest,
    ChatMessage,
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
from pd_orchestrator.prefix.hashing import BlockExtras
from pd_orchestrator.sim.engine import (
    Engine,
    EngineConfig,
    EngineRequest,
    RequestOutput,
    SamplingSpec,
)
from pd_orchestrator.sim.faults import corrupt
from pd_orchestrator.sim.handover import (
    Advertised,
    Fetched,
    TransferFailed,
    external_kv,
    fetch,
    hold_keys,
    plan_fetch,
    producer_params,
)
from pd_orchestrator.sim.metrics import SimMetrics
from pd_orchestrator.sim.options import SimOptions, connector_names
from pd_orchestrator.sim.runner import EngineRunner
from pd_orchestrator.sim.tokenizer import WORD_BASE, SimTokenizer

if TYPE_CHECKING:
    from pd_orchestrator.sim.kv_events import KvEventPublisher


__all__ = ["SimServer", "bind_socket", "serve"]

logger = logging.getLogger("pd_orchestrator.sim")

_SIDE_CHANNEL_CONNECT = 10.0
_NIXL = frozenset({"nixl", "nixl-push"})


class HTTPFailure(Exception):
    """An error answer: HTTP status, message, and the offending parameter if any."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, self.status, param=self.param), self.status)


class _DroppedConnection(Exception):
    """Raised inside a stream to make the server drop the connection (fault injection)."""


@dataclass(frozen=True, slots=True)
class _Job:
    """One accepted generation request."""

    kind: Kind
    request: OpenAIRequest
    request_id: str
    prompt_ids: list[int]
    arrival: float
    drop_after: int | None


def _publisher(options: SimOptions) -> KvEventPublisher | None:
    if options.kv_events_endpoint is None:
        return None
    from pd_orchestrator.sim.kv_events import KvEventPublisher  # pyzmq: the "events" extra

    return KvEventPublisher(
        options.kv_events_endpoint,
        options.kv_events_replay_endpoint,
        topic=options.kv_events_topic,
        buffer_steps=options.kv_events_buffer_steps,
        int_hashes=options.kv_events_int_hashes,
    )


class _ApiKeyGuard:
    """vLLM's ``--api-key``: ``/v1`` routes answer 401 without ``Bearer <a key>``."""

    def __init__(self, app: ASGIApp, keys: tuple[str, ...]) -> None:
        self.app = app
        self.keys = tuple(key.encode() for key in keys)

    def _allows(self, value: str | None) -> bool:
        scheme, _, token = (value or "").partition(" ")
        if scheme.lower() != "bearer":
            return False
        matched = False
        for key in self.keys:
            matched |= secrets.compare_digest(token.encode(), key)
        return matched

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            if not self._allows(Headers(scope=scope).get("authorization")):
                response = JSONResponse({"error": "Unauthorized"}, status_code=401)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class SimServer:
    """One simulated vLLM instance: engine, real-time runner, metrics and routes."""

    def __init__(self, options: SimOptions, clock: Callable[[], float] = time.monotonic) -> None:
        self.options = options
        self.model = options.served_model
        self.engine_id = options.engine_id or f"sim-{uuid.uuid4().hex[:12]}"
        self.port = options.port
        self.clock = clock
        self.tokenizer = SimTokenizer()
        self.connectors = connector_names(options.kv_connector)
        self.engine = Engine(self._engine_config(), external=external_kv(options))
        self.kv_events = _publisher(options)
        self.runner = EngineRunner(
            self.engine,
            options.time_scale,
            clock=clock,
            on_events=self.kv_events.publish if self.kv_events is not None else None,
        )
        self.metrics = SimMetrics(self.engine, self.model, self.engine_id)
        fault_seed = options.seed if options.fault_seed is None else options.fault_seed
        self._rng = random.Random(fault_seed)
        self._client: httpx.AsyncClient | None = None
        self.ready = anyio.Event()

    def _engine_config(self) -> EngineConfig:
        options = self.options
        connector = None if options.kv_connector == "none" else options.kv_connector
        return EngineConfig(
            profile=options.latency,
            model=self.model,
            block_size=options.block_size,
            num_kv_blocks=options.kv_blocks,
            max_num_seqs=options.max_num_seqs,
            max_num_batched_tokens=options.max_num_batched_tokens,
            global_cache_hit_threshold=options.global_cache_hit_threshold,
            seed=options.seed,
            hash_seed=options.hash_seed,
            hash_algo=options.hash_algo,
            lease_seconds=options.lease_seconds,
            record_events=options.kv_events_endpoint is not None,
            kv_connector=connector,
        )

    # -- application ----------------------------------------------------------------
    def app(self) -> Starlette:
        """The ASGI application; its lifespan runs the engine loop."""
        routes = [
            Route("/v1/completions", self._wrap(self.completions), methods=["POST"]),
            Route("/v1/chat/completions", self._wrap(self.chat_completions), methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics_endpoint, methods=["GET"]),
            Route("/version", self.version, methods=["GET"]),
            Route("/tokenize", self._wrap(self.tokenize), methods=["POST"]),
            Route("/detokenize", self._wrap(self.detokenize), methods=["POST"]),
            Route("/reset_prefix_cache", self.reset_prefix_cache, methods=["POST"]),
            Route("/nixl/pull", self._wrap(self.nixl_pull), methods=["POST"]),
            Route("/nixl/push", self._wrap(self.nixl_push), methods=["POST"]),
            Route("/query", self._wrap(self.mooncake_query), methods=["GET"]),
            Route("/mooncake/pull", self._wrap(self.mooncake_pull), methods=["POST"]),
            Route("/moriio/notify", self._wrap(self.moriio_notify), methods=["POST"]),
            Route("/p2p/fetch", self._wrap(self.p2p_fetch), methods=["POST"]),
            Route("/p2p/lookup", self._wrap(self.p2p_lookup), methods=["POST"]),
        ]
        keys = self.options.api_keys
        middleware = [Middleware(_ApiKeyGuard, keys=keys)] if keys else []
        return Starlette(routes=routes, lifespan=self._lifespan, middleware=middleware)

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        timeout = httpx.Timeout(self.options.lease_seconds + 5.0, connect=_SIDE_CHANNEL_CONNECT)
        async with (
            httpx.AsyncClient(timeout=timeout) as client,
            anyio.create_task_group() as tg,
        ):
            self._client = client
            if self.kv_events is not None:
                await tg.start(self.kv_events.run)
            await tg.start(self.runner.run)
            self.ready.set()
            yield
            tg.cancel_scope.cancel()

    @staticmethod
    def _wrap(
        handler: Callable[[Request], Awaitable[Response]],
    ) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            try:
                return await handler(request)
            except HTTPFailure as failure:
                return failure.response()

        return endpoint

    # -- simple routes ----------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        if self.options.health_delay:
            await anyio.sleep(self.options.health_delay)
        return Response(status_code=200)

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": f"pd-orchestrator-sim {__version__}"})

    async def models(self, request: Request) -> Response:
        card = {
            "id": self.model,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "vllm",
            "root": self.model,
            "parent": None,
            "max_model_len": self.options.max_model_len,
        }
        return JSONResponse({"object": "list", "data": [card]})

    async def metrics_endpoint(self, request: Request) -> Response:
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def reset_prefix_cache(self, request: Request) -> Response:
        if not self.engine.reset_prefix_cache():
            return JSONResponse(error_body("blocks are in use", 409), 409)
        self.runner.flush_events()
        return Response(status_code=200)

    async def tokenize(self, request: Request) -> Response:
        body = await _json_object(request)
        if "messages" in body:
            messages = [ChatMessage.model_validate(m) for m in _list_field(body, "messages")]
            text = render_chat(messages, bool(body.get("add_generation_prompt", True)))
        elif isinstance(body.get("prompt"), str):
            text = body["prompt"]
        else:
            raise HTTPFailure(400, "prompt: a string is required", "prompt")
        tokens = self.tokenizer.encode(text)
        return JSONResponse(
            {
                "count": len(tokens),
                "max_model_len": self.options.max_model_len,
                "tokens": tokens,
                "token_strs": None,
            }
        )

    async def detokenize(self, request: Request) -> Response:
        body = await _json_object(request)
        tokens = _list_field(body, "tokens")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise HTTPFailure(400, "tokens: a list of integers is required", "tokens")
        self._check_vocab(tokens)
        return JSONResponse({"prompt": self.tokenizer.decode(tokens)})

    # -- KV side channels (producer side) ----------------------------------------------
    def _advertised(self) -> Advertised:
        return Advertised(
            self.engine_id, self.options.side_channel_host or self.options.host, self.port
        )

    def _speaks(self, name: str) -> None:
        if name not in self.connectors:
            raise HTTPFailure(404, f"this instance does not speak the {name} connector")

    def _check_block_size(self, body: dict[str, Any]) -> None:
        if body.get("block_size") not in (None, self.options.block_size):
            raise HTTPFailure(409, "block size mismatch")

    def _check_engine(self, body: dict[str, Any]) -> None:
        if body.get("remote_engine_id") != self.engine_id:
            raise HTTPFailure(409, f"engine id mismatch: this is {self.engine_id!r}")

    @staticmethod
    def _blocks(held: Fetched | None, what: str) -> Response:
        if held is None:
            raise HTTPFailure(404, f"no KV blocks held for {what}")
        hashes = [h.hex() for h in held.block_hashes]
        return JSONResponse({"block_hashes": hashes, "num_tokens": held.num_tokens})

    async def _claim(self, key: str) -> Fetched | None:
        held = await self.runner.claim(key, self.options.lease_seconds)
        return None if held is None else Fetched(held.block_hashes, held.num_tokens)

    async def nixl_pull(self, request: Request) -> Response:
        """The decoder READs blocks held for ``remote_request_id`` (they must be held)."""
        body = await _json_object(request)
        self._check_engine(body)
        self._check_block_size(body)
        request_id = body.get("remote_request_id")
        held = self.runner.release(f"nixl:{request_id}") if request_id else None
        fetched = None if held is None else Fetched(held.block_hashes, held.num_tokens)
        return self._blocks(fetched, f"request {request_id!r}")

    async def nixl_push(self, request: Request) -> Response:
        """A decoder registers its blocks for base ``request_id``; this instance writes."""
        self._speaks("nixl-push")
        body = await _json_object(request)
        self._check_engine(body)
        self._check_block_size(body)
        request_id = body.get("request_id")
        return self._blocks(await self._claim(f"nixl-push:{request_id}"), f"{request_id!r}")

    async def mooncake_query(self, request: Request) -> Response:
        """Mooncake's bootstrap server: ``{dp_rank: {engine_id, worker_addr}}``."""
        self._speaks("mooncake")
        me = self._advertised()
        worker = f"http://{me.host}:{me.port}"
        return JSONResponse({"0": {"engine_id": me.engine_id, "worker_addr": {"0": {"0": worker}}}})

    async def mooncake_pull(self, request: Request) -> Response:
        self._speaks("mooncake")
        body = await _json_object(request)
        self._check_block_size(body)
        transfer_id = body.get("transfer_id")
        return self._blocks(await self._claim(f"mooncake:{transfer_id}"), f"{transfer_id!r}")

    async def moriio_notify(self, request: Request) -> Response:
        """A decoder's "blocks ready" notice; this instance writes once it holds the KV."""
        self._speaks("moriio")
        body = await _json_object(request)
        self._check_block_size(body)
        transfer_id = body.get("transfer_id")
        return self._blocks(await self._claim(f"moriio:{transfer_id}"), f"{transfer_id!r}")

    async def p2p_fetch(self, request: Request) -> Response:
        self._speaks("offloading")
        body = await _json_object(request)
        self._check_block_size(body)
        kv_request_id = body.get("kv_request_id")
        held = await self._claim(f"offloading:{kv_request_id}")
        return self._blocks(held, f"{kv_request_id!r}")

    async def p2p_lookup(self, request: Request) -> Response:
        """Which leading blocks of a prompt this instance's prefix cache holds."""
        self._speaks("offloading")
        body = await _json_object(request)
        self._check_block_size(body)
        try:
            hashes = [bytes.fromhex(h) for h in body.get("block_hashes") or []]
        except (TypeError, ValueError):
            raise HTTPFailure(400, "block_hashes: a list of hex strings is required") from None
        size = self.options.block_size
        tokens = self.engine.local_hit_tokens_of(hashes, len(hashes) * size + 1)
        return self._blocks(Fetched(tuple(hashes[: tokens // size]), tokens), "lookup")

    # -- generation -------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        return await self._generate(request, "completion")

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, "chat")

    async def _generate(self, http_request: Request, kind: Kind) -> Response:
        self._inject_faults(http_request)
        if self.options.response_delay:
            await anyio.sleep(self.options.response_delay)
        job = await self._accept(http_request, kind)
        external = await self._fetch_external(job)
        receive = self._submit(job, external, http_request)
        headers = {"x-request-id": job.request_id}
        if job.request.stream:
            return StreamingResponse(
                self._stream(job, receive), media_type="text/event-stream", headers=headers
            )
        body = await _until_disconnect(http_request, self._collect(job, receive))
        return JSONResponse(body or {}, headers=headers)

    def _inject_faults(self, request: Request) -> None:
        forced = request.headers.get("x-return-error")
        if forced is not None:
            status = int(forced) if forced.isdigit() else 500
            raise HTTPFailure(status, f"injected error {status} (X-Return-Error)")
        if self.options.failure_rate and self._rng.random() < self.options.failure_rate:
            raise HTTPFailure(500, "injected failure (--failure-rate)")

    async def _accept(self, http_request: Request, kind: Kind) -> _Job:
        body = await _json_object(http_request)
        try:
            request = parse_for(kind, body)
        except RequestError as exc:
            raise HTTPFailure(400, str(exc), exc.param) from None
        if request.n != 1:
            raise HTTPFailure(400, "the simulator generates one choice per request (n=1)", "n")
        if request.model != self.model:
            raise HTTPFailure(404, f"The model `{request.model}` does not exist.", "model")
        prompt_ids = self._prompt_ids(request)
        base = http_request.headers.get("x-request-id") or uuid.uuid4().hex
        prefix = "cmpl" if kind == "completion" else "chatcmpl"
        drop = http_request.headers.get("x-drop-after-tokens")
        return _Job(
            kind=kind,
            request=request,
            request_id=f"{prefix}-{base}-{uuid.uuid4().hex[:8]}",
            prompt_ids=prompt_ids,
            arrival=self.clock(),
            drop_after=int(drop) if drop and drop.isdigit() else self.options.drop_after_tokens,
        )

    def _prompt_ids(self, request: OpenAIRequest) -> list[int]:
        if isinstance(request, ChatCompletionRequest):
            ids = self.tokenizer.encode(
                render_chat(request.messages, request.add_generation_prompt)
            )
        elif isinstance(request.prompt, str):
            ids = self.tokenizer.encode(request.prompt)
        else:
            ids = list(request.prompt)
            self._check_vocab(ids)
        if not ids:
            raise HTTPFailure(400, "The decoder prompt cannot be empty", "prompt")
        if len(ids) >= self.options.max_model_len:
            raise HTTPFailure(
                400,
                f"This model's maximum context length is {self.options.max_model_len} tokens; "
                f"the prompt has {len(ids)} tokens.",
                "prompt",
            )
        return ids

    def _check_vocab(self, ids: list[int]) -> None:
        try:
            self.tokenizer.validate(ids)
        except ValueError as exc:
            raise HTTPFailure(400, str(exc), "prompt") from None

    def _sampling(self, job: _Job) -> SamplingSpec:
        request = job.request
        limit = request.output_limit()
        room = min(self.options.max_model_len, self.engine.capacity_tokens()) - len(job.prompt_ids)
        if limit is None:
            limit = 16 if job.kind == "completion" else max(1, room)
        if request.min_tokens > limit:
            raise HTTPFailure(
                400, "min_tokens must be less than or equal to max_tokens", "min_tokens"
            )
        return SamplingSpec(
            max_tokens=limit, min_tokens=request.min_tokens, ignore_eos=request.ignore_eos
        )

    def _submit(
        self, job: _Job, external: int, http_request: Request
    ) -> MemoryObjectReceiveStream[RequestOutput]:
        params = job.request.kv_transfer_params or {}
        forced = http_request.headers.get("x-cache-threshold-finish-reason", "").lower() == "true"
        forced = forced or self.options.always_reject
        engine_request = EngineRequest(
            request_id=job.request_id,
            prompt_token_ids=job.prompt_ids,
            sampling=self._sampling(job),
            cache_hit_threshold=job.request.cache_hit_threshold,
            do_remote_decode=bool(params.get("do_remote_decode")),
            external_tokens=external,
            force_reject=forced,
            extras=_extras(job.request),
            hold_keys=hold_keys(self.connectors, params, job.request_id),
        )
        try:
            return self.runner.submit(engine_request)
        except ValueError as exc:
            raise HTTPFailure(400, str(exc)) from None

    # -- KV transfer (consumer side) -------------------------------------------------------
    async def _fetch_external(self, job: _Job) -> int:
        """Tokens of ``job``'s prompt whose KV came from a producer (0: none)."""
        params = job.request.kv_transfer_params or {}
        extras = _extras(job.request)
        try:
            plan = plan_fetch(self.connectors, params, job.request_id)
            if plan is None:
                return 0
            assert self._client is not None
            hashes = self.engine.prompt_hashes(job.prompt_ids, extras)
            fetched = await fetch(self._client, plan, self.options.block_size, hashes)
        except TransferFailed as exc:
            if self.options.kv_load_failure_policy == "recompute":
                return 0
            raise HTTPFailure(500, f"KV transfer failed: {exc}") from None
        external = self._matched_tokens(job.prompt_ids, fetched, extras)
        moved = max(0, external - self.engine.local_hit_tokens(job.prompt_ids, extras))
        seconds = self.options.latency.transfer_seconds(moved)
        await anyio.sleep(self.runner.scaled(seconds))
        if plan.connector in _NIXL:
            self.metrics.observe_transfer(seconds, moved * self.options.latency.kv_bytes_per_token)
        return external

    def _matched_tokens(
        self, prompt_ids: list[int], held: Fetched, extras: BlockExtras | None
    ) -> int:
        own = self.engine.prompt_hashes(prompt_ids, extras)
        matched = 0
        for mine, theirs in zip(own, held.block_hashes, strict=False):
            if mine != theirs:
                break
            matched += 1
        if matched == len(own) and held.num_tokens == len(prompt_ids):
            return len(prompt_ids)
        return matched * self.options.block_size

    # -- answers ------------------------------------------------------------------------
    def _usage(self, job: _Job, last: RequestOutput | None) -> Usage:
        if last is None:
            return Usage(len(job.prompt_ids), 0)
        return Usage(last.num_prompt_tokens, last.num_output_tokens, last.num_cached_tokens)

    def _observe(self, job: _Job, first_token_at: float | None) -> None:
        now = self.clock()
        if first_token_at is not None:
            self.metrics.observe_ttft(first_token_at - job.arrival)
        self.metrics.observe_e2e(now - job.arrival)

    async def _collect(
        self, job: _Job, receive: MemoryObjectReceiveStream[RequestOutput]
    ) -> dict[str, Any]:
        tokens: list[int] = []
        last: RequestOutput | None = None
        first_at: float | None = None
        try:
            async with receive:
                async for output in receive:
                    if output.new_token_ids and first_at is None:
                        first_at = self.clock()
                    tokens += output.new_token_ids
                    last = output
        finally:
            self.runner.abort(job.request_id)
        self._observe(job, first_at)
        transfer = last.transfer if last is not None else None
        request = job.request
        answer = completion_body(
            kind=job.kind,
            response_id=job.request_id,
            model=self.model,
            text=self.tokenizer.decode(tokens),
            finish_reason=last.finish_reason.value if last and last.finish_reason else "abort",
            usage=self._usage(job, last),
            token_ids=tokens if request.return_token_ids else None,
            prompt_token_ids=job.prompt_ids if request.return_token_ids else None,
            kv_transfer_params=(
                producer_params(
                    self.connectors, transfer, last.num_cached_tokens, self._advertised()
                )
                if transfer is not None and last is not None
                else None
            ),
        )
        return corrupt(answer, self.options.protocol_fault)

    async def _stream(
        self, job: _Job, receive: MemoryObjectReceiveStream[RequestOutput]
    ) -> AsyncIterator[bytes]:
        created = int(time.time())
        request = job.request
        want_ids = request.return_token_ids
        prompt_ids: list[int] | None = job.prompt_ids if want_ids else None
        fault = self.options.protocol_fault

        def chunk(text: str | None, **fields: Any) -> bytes:
            body = stream_chunk(
                kind=job.kind,
                response_id=job.request_id,
                model=self.model,
                created=created,
                text=text,
                **fields,
            )
            return encode_event(corrupt(body, fault))

        last: RequestOutput | None = None
        first_at: float | None = None
        sent = 0
        try:
            if job.kind == "chat":
                yield chunk(None, role=True, prompt_token_ids=prompt_ids)
                prompt_ids = None
            async with receive:
                async for output in receive:
                    last = output
                    if output.new_token_ids and first_at is None:
                        first_at = self.clock()
                    reason = output.finish_reason.value if output.finish_reason else None
                    text = self.tokenizer.decode(output.new_token_ids)
                    if job.kind == "chat" and not output.new_token_ids:
                        text_or_none: str | None = None
                    else:
                        text_or_none = text
                    yield chunk(
                        text_or_none,
                        finish_reason=reason,
                        token_ids=list(output.new_token_ids) if want_ids else None,
                        prompt_token_ids=prompt_ids,
                    )
                    prompt_ids = None
                    sent += len(output.new_token_ids)
                    if (
                        job.drop_after is not None
                        and sent >= job.drop_after
                        and not output.finished
                    ):
                        raise _DroppedConnection(f"dropping the stream after {sent} tokens")
            if fault == "tokens-after-finish":
                extra = [WORD_BASE]
                yield chunk(self.tokenizer.decode(extra), token_ids=extra if want_ids else None)
            self._observe(job, first_at)
            if request.include_usage:
                usage = self._usage(job, last)
                yield encode_event(
                    usage_chunk(
                        kind=job.kind,
                        response_id=job.request_id,
                        model=self.model,
                        created=created,
                        usage=usage,
                    )
                )
            yield DONE
        finally:
            self.runner.abort(job.request_id)


def _extras(request: OpenAIRequest) -> BlockExtras | None:
    """The request's ``cache_salt`` (a vLLM extension field) as block-hash extras."""
    salt = (request.model_extra or {}).get("cache_salt")
    return BlockExtras(cache_salt=salt) if isinstance(salt, str) and salt else None


async def _until_disconnect(
    request: Request, work: Coroutine[Any, Any, dict[str, Any]]
) -> dict[str, Any] | None:
    """Run ``work`` unless the client disconnects first (vLLM aborts such requests)."""
    result: dict[str, Any] | None = None
    async with anyio.create_task_group() as tg:

        async def watch() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            tg.cancel_scope.cancel()

        tg.start_soon(watch)
        result = await work
        tg.cancel_scope.cancel()
    return result


async def _json_object(request: Request) -> dict[str, Any]:
    try:
        return decode_json_object(await request.body())
    except RequestError as exc:
        raise HTTPFailure(400, str(exc)) from None


def _list_field(body: dict[str, Any], name: str) -> list[Any]:
    value = body.get(name)
    if not isinstance(value, list):
        raise HTTPFailure(400, f"{name}: a list is required", name)
    return value


def bind_socket(host: str, port: int, *, reuse_port: bool = False) -> socket.socket:
    """A listening TCP socket on ``host:port`` (``port`` 0 picks a free one);
    ``reuse_port``: other processes may listen on the same port (the kernel spreads
    connections over them)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP explicitly: asyncio only sets TCP_NODELAY on accepted sockets whose
    # protocol says TCP, and without it keep-alive responses wait ~40 ms (Nagle).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


async def serve(options: SimOptions, *, announce: bool = True) -> None:
    """Run a simulated instance until cancelled.

    The socket is bound first so ``port`` 0 works; with ``announce`` the line
    ``READY http://HOST:PORT`` goes to stdout once the server accepts requests.
    """
    sock = bind_socket(options.host, options.port)
    sim = SimServer(options)
    sim.port = sock.getsockname()[1]
    config = uvicorn.Config(
        sim.app(),
        log_level="warning",
        log_config=None,  # uvicorn's records go through the process's logging setup
        lifespan="on",
        timeout_graceful_shutdown=2,
    )
    server = uvicorn.Server(config)
    async with anyio.create_task_group() as tg:
        tg.start_soon(server.serve, [sock])
        await sim.ready.wait()
        logger.info(
            "simulated instance on http://%s:%d (model %s, profile %s, connector %s)",
            options.host, sim.port, sim.model, options.profile, options.kv_connector,
        )  # fmt: skip
        if announce:
            print(f"READY http://{options.host}:{sim.port}", flush=True, file=sys.stdout)
