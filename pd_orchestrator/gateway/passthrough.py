"""Routes the gateway forwards to one decoder: ``/tokenize`` and ``/detokenize``; and
``/version``.

``POST /tokenize`` and ``POST /detokenize`` go, unchanged, to a healthy decoder that
serves the body's ``model`` (any decoder when the body names none; decoders take
turns), as a ``tokenize`` leg, once the body passed the same reading and checks as
a completion's (:func:`~pd_orchestrator.gateway.admission.read_json`: 413 and 400,
never forwarded): the decoder's tokenizer is the one the completion
routes use, so a client that aligns prompts with it (``vllm bench serve`` does)
gets the lengths it asked for. A model no decoder serves is a 404, a decoder that
fails is the usual upstream error, both in the OpenAI error shape.

``GET /version`` answers this gateway's version and, under ``upstreams``, each
endpoint's own ``/version`` (``null`` when it did not answer within a second).
"""

from __future__ import annotations

from typing import Any

import anyio
import orjson

from pd_orchestrator import __version__
from pd_orchestrator.flows.sink import GatewayError
from pd_orchestrator.gateway.admission import unknown_model
from pd_orchestrator.gateway.state import GatewayState
from pd_orchestrator.model.endpoints import Endpoint, Role
from pd_orchestrator.openai.errors import echoed
from pd_orchestrator.upstream.client import Upstream
from pd_orchestrator.upstream.errors import UpstreamError

__all__ = ["TOKENIZER_ROUTES", "VERSION_SECONDS", "tokenizer_decoder", "versions"]

TOKENIZER_ROUTES = ("/tokenize", "/detokenize")
VERSION_SECONDS = 1.0
"""How long ``/version`` waits for each endpoint's version."""


def tokenizer_decoder(state: GatewayState, model: object, turn: int) -> Endpoint:
    """The decoder that tokenizes for ``model`` (see the module docstring)."""
    if model is not None and not isinstance(model, str):
        raise GatewayError(400, "model: a string is expected", "model")
    if model is not None and state.models and model not in state.models:
        raise unknown_model(model)
    serving = [
        status
        for status in state.fleet.snapshot(Role.DECODE)
        if model is None or status.endpoint.model in (None, model)
    ]
    if not serving:
        raise GatewayError(503, f"no decoder serves the model `{echoed(model)}`")
    healthy = [
        s for s in serving if s.healthy and state.scraper.is_responsive(s.endpoint.name)
    ] or serving
    return healthy[turn % len(healthy)].endpoint


async def _version(upstream: Upstream, endpoint: Endpoint) -> str | None:
    try:
        reply = await upstream.get(endpoint, "/version", limit=VERSION_SECONDS)
    except UpstreamError:
        return None
    if reply.status_code != 200:
        return None
    try:
        version = orjson.loads(reply.content).get("version")
    except (orjson.JSONDecodeError, AttributeError):
        return None
    return version if isinstance(version, str) else None


async def versions(state: GatewayState, upstream: Upstream) -> dict[str, Any]:
    """``GET /version``: this gateway's version and each endpoint's, by name."""
    found: dict[str, str | None] = {}

    async def ask(endpoint: Endpoint) -> None:
        found[endpoint.name] = await _version(upstream, endpoint)

    endpoints = state.fleet.endpoints()
    with anyio.move_on_after(VERSION_SECONDS * 2):
        async with anyio.create_task_group() as tg:
            for endpoint in endpoints:
                tg.start_soon(ask, endpoint)
    return {
        "version": __version__,
        "upstreams": {e.name: found.get(e.name) for e in endpoints},
    }
