"""Admission: a completion request read, parsed once and checked, before any routing.

:func:`read_body` reads the body; :func:`admit` decodes it (400 unless a JSON
object), parses it into its typed view (400 naming the field), checks the model
(404) and, in sidecar mode, the prefillers a request names in its header (403 unless
allow-listed), and returns the request (raw body kept for pass-through, typed view
for everything the gateway reads) with the planner's view of it
(:class:`~pd_orchestrator.planner.plan.RequestFacts`). Nothing later reads the raw
body again except to forward it.
"""

from __future__ import annotations

import itertools
import re
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import orjson

from pd_orchestrator.fleet.endpoints import Endpoint, Role
from pd_orchestrator.flows.request import ClientRequest
from pd_orchestrator.flows.sink import GatewayError
from pd_orchestrator.gateway.state import GatewayState
from pd_orchestrator.openai.protocol import RequestError, parse_for
from pd_orchestrator.openai.responses import Kind
from pd_orchestrator.planner.plan import RequestFacts
from pd_orchestrator.prefix.runtime import PrefixFields

__all__ = ["Admitted", "RequestIds", "admit", "header_map", "request_id_of"]

_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")


@dataclass(frozen=True, slots=True)
class Admitted:
    """A request that passed admission, and what the planner will see of it."""

    request: ClientRequest
    facts: RequestFacts


class RequestIds:
    """New request ids: a random prefix per process, then a counter (unique across
    processes and restarts, and cheaper than a UUID per request)."""

    def __init__(self) -> None:
        self._prefix = uuid.uuid4().hex[:12]
        self._next = itertools.count(1)

    def new(self) -> str:
        return f"{self._prefix}{next(self._next):08x}"


def request_id_of(value: str | None, ids: RequestIds) -> str:
    """The client's ``x-request-id`` when it is a plain token, else a new id."""
    if value is not None and _REQUEST_ID.fullmatch(value):
        return value
    return ids.new()


def _decode(raw: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise GatewayError(400, f"malformed JSON body: {exc}") from None
    if not isinstance(body, dict):
        raise GatewayError(400, "the request body must be a JSON object")
    return body


def admit(
    state: GatewayState,
    kind: Kind,
    path: str,
    raw: bytes,
    headers: dict[str, str],
    arrival: float,
    ids: RequestIds,
) -> Admitted:
    """Admit one completion request (see the module docstring); raises GatewayError."""
    body = _decode(raw)
    try:
        view = parse_for(kind, body)
    except RequestError as exc:
        raise GatewayError(400, str(exc), exc.param) from None
    if state.models and view.model not in state.models:
        raise GatewayError(404, f"The model `{view.model}` does not exist.", "model")
    request = ClientRequest(
        kind=kind,
        path=path,
        body=body,
        view=view,
        request_id=request_id_of(headers.get("x-request-id"), ids),
        arrival=arrival,
    )
    return Admitted(request, facts(request, state.prefix.view_fields(view), _named(state, headers)))


def facts(
    request: ClientRequest, fields: PrefixFields, prefillers: tuple[Endpoint, ...] | None
) -> RequestFacts:
    """What the planner sees of ``request``."""
    return RequestFacts(
        model=request.model,
        prompt_chars=request.prompt_chars,
        affinity_key=request.affinity_key(),
        fields=fields,
        client_threshold=request.view.cache_hit_threshold,
        prefillers=prefillers,
    )


def _named(state: GatewayState, headers: dict[str, str]) -> tuple[Endpoint, ...] | None:
    """The sidecar header's prefillers (allow-listed), or None without the header."""
    sidecar = state.config.sidecar
    header = headers.get(sidecar.prefiller_header.lower()) if sidecar.enabled else None
    if header is None:
        return None
    chosen = []
    for item in (part.strip().lower() for part in header.split(",")):
        if not item:
            continue
        if item not in state.allowed_prefillers:
            raise GatewayError(403, f"prefiller {item!r} is not in the allow-list")
        chosen.append(_prefiller(state, item))
    if not chosen:
        raise GatewayError(400, f"header {sidecar.prefiller_header} names no prefiller")
    return tuple(chosen)


def _prefiller(state: GatewayState, host_port: str) -> Endpoint:
    fleet = state.fleet
    for endpoint in fleet.endpoints(Role.PREFILL):
        if endpoint.host_port == host_port:
            return endpoint
    decoder = fleet.endpoints(Role.DECODE)[0]
    return Endpoint(
        name=host_port,
        url=f"http://{host_port}",
        role=Role.PREFILL,
        group=decoder.group,
        connector=decoder.connector,
    )


def header_map(raw: Iterable[tuple[bytes, bytes]]) -> dict[str, str]:
    """ASGI headers as a dict of lower-case names (the last value of a repeated one)."""
    return {name.decode("latin-1").lower(): value.decode("latin-1") for name, value in raw}
