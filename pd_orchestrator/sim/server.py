"""HTTP front of a simulated vLLM instance (vLLM's OpenAI server surface): the app,
its lifespan (the engine loop, the KV-event publisher), the simple routes; the
generation routes are in :mod:`~pd_orchestrator.sim.completions`, the KV side
channels in :mod:`~pd_orchestrator.sim.side_channels`.

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
  and ``--protocol-fault`` sends answers no vLLM would (:mod:`pd_orchestrator.sim.faults`);
* ``--no-admission-only`` is an older threshold plugin: ``cache_hit_admission_only``
  is ignored and ``vllm:cache_threshold_admission_only`` not exported.
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
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

import anyio
import httpx
import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from pd_orchestrator import __version__
from pd_orchestrator.openai.errors import error_body
from pd_orchestrator.openai.protocol import (
    ChatMessage,
    render_chat,
)
from pd_orchestrator.sim.completions import Completions
from pd_orchestrator.sim.engine import (
    Engine,
    EngineConfig,
)
from pd_orchestrator.sim.handover import (
    external_kv,
)
from pd_orchestrator.sim.instance import (
    HTTPFailure,
    Instance,
    check_vocab,
    json_object,
    list_field,
    wrap,
)
from pd_orchestrator.sim.metrics import SimMetrics
from pd_orchestrator.sim.options import SimOptions, connector_names
from pd_orchestrator.sim.runner import EngineRunner
from pd_orchestrator.sim.side_channels import SideChannels
from pd_orchestrator.sim.tokenizer import SimTokenizer

if TYPE_CHECKING:
    from pd_orchestrator.sim.kv_events import KvEventPublisher


__all__ = ["SimServer", "bind_socket", "serve"]

logger = logging.getLogger("pd_orchestrator.sim")

_SIDE_CHANNEL_CONNECT = 10.0


def _engine_config(options: SimOptions, model: str) -> EngineConfig:
    connector = None if options.kv_connector == "none" else options.kv_connector
    return EngineConfig(
        profile=options.latency,
        model=model,
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
    """One simulated vLLM instance: its parts (:class:`.instance.Instance`) and its
    HTTP front; the generation routes are :class:`.completions.Completions`, the KV
    producer side :class:`.side_channels.SideChannels`."""

    def __init__(self, options: SimOptions, clock: Callable[[], float] = time.monotonic) -> None:
        self.options = options
        model = options.served_model
        engine = Engine(_engine_config(options, model), external=external_kv(options))
        self.kv_events = _publisher(options)
        runner = EngineRunner(
            engine,
            options.time_scale,
            clock=clock,
            on_events=self.kv_events.publish if self.kv_events is not None else None,
        )
        engine_id = options.engine_id or f"sim-{uuid.uuid4().hex[:12]}"
        self.instance = Instance(
            options=options,
            model=model,
            engine_id=engine_id,
            port=options.port,
            clock=clock,
            tokenizer=SimTokenizer(),
            connectors=connector_names(options.kv_connector),
            engine=engine,
            runner=runner,
            metrics=SimMetrics(engine, model, engine_id, admission_only=options.admission_only),
        )
        fault_seed = options.seed if options.fault_seed is None else options.fault_seed
        self.completions = Completions(self.instance, random.Random(fault_seed))
        self.side_channels = SideChannels(self.instance)
        self.ready = anyio.Event()

    @property
    def model(self) -> str:
        return self.instance.model

    @property
    def engine(self) -> Engine:
        return self.instance.engine

    @property
    def port(self) -> int:
        return self.instance.port

    @port.setter
    def port(self, port: int) -> None:
        self.instance.port = port

    # -- application ----------------------------------------------------------------
    def app(self) -> Starlette:
        """The ASGI application; its lifespan runs the engine loop."""
        generate, side = self.completions, self.side_channels
        routes = [
            Route("/v1/completions", wrap(generate.completions), methods=["POST"]),
            Route("/v1/chat/completions", wrap(generate.chat_completions), methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics_endpoint, methods=["GET"]),
            Route("/version", self.version, methods=["GET"]),
            Route("/tokenize", wrap(self.tokenize), methods=["POST"]),
            Route("/detokenize", wrap(self.detokenize), methods=["POST"]),
            Route("/reset_prefix_cache", self.reset_prefix_cache, methods=["POST"]),
            Route("/nixl/pull", wrap(side.nixl_pull), methods=["POST"]),
            Route("/nixl/push", wrap(side.nixl_push), methods=["POST"]),
            Route("/query", wrap(side.mooncake_query), methods=["GET"]),
            Route("/mooncake/pull", wrap(side.mooncake_pull), methods=["POST"]),
            Route("/moriio/notify", wrap(side.moriio_notify), methods=["POST"]),
            Route("/p2p/fetch", wrap(side.p2p_fetch), methods=["POST"]),
            Route("/p2p/lookup", wrap(side.p2p_lookup), methods=["POST"]),
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
            self.instance.client = client
            if self.kv_events is not None:
                await tg.start(self.kv_events.run)
            await tg.start(self.instance.runner.run)
            self.ready.set()
            yield
            tg.cancel_scope.cancel()

    # -- simple routes ----------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        if self.options.health_delay:
            await anyio.sleep(self.options.health_delay)
        return Response(status_code=200)

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": f"pd-orchestrator-sim {__version__}"})

    async def models(self, request: Request) -> Response:
        card = {
            "id": self.instance.model,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "vllm",
            "root": self.instance.model,
            "parent": None,
            "max_model_len": self.options.max_model_len,
        }
        return JSONResponse({"object": "list", "data": [card]})

    async def metrics_endpoint(self, request: Request) -> Response:
        return Response(
            generate_latest(self.instance.metrics.registry), media_type=CONTENT_TYPE_LATEST
        )

    async def reset_prefix_cache(self, request: Request) -> Response:
        if not self.instance.engine.reset_prefix_cache():
            return JSONResponse(error_body("blocks are in use", 409), 409)
        self.instance.runner.flush_events()
        return Response(status_code=200)

    async def tokenize(self, request: Request) -> Response:
        body = await json_object(request)
        if "messages" in body:
            messages = [ChatMessage.model_validate(m) for m in list_field(body, "messages")]
            text = render_chat(messages, bool(body.get("add_generation_prompt", True)))
        elif isinstance(body.get("prompt"), str):
            text = body["prompt"]
        else:
            raise HTTPFailure(400, "prompt: a string is required", "prompt")
        tokens = self.instance.tokenizer.encode(text)
        self.instance.engine.stats.tokenized_tokens += len(tokens)
        return JSONResponse(
            {
                "count": len(tokens),
                "max_model_len": self.options.max_model_len,
                "tokens": tokens,
                "token_strs": None,
            }
        )

    async def detokenize(self, request: Request) -> Response:
        body = await json_object(request)
        tokens = list_field(body, "tokens")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise HTTPFailure(400, "tokens: a list of integers is required", "tokens")
        tokenizer = self.instance.tokenizer
        check_vocab(tokenizer, tokens)
        return JSONResponse({"prompt": tokenizer.decode(tokens)})


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
