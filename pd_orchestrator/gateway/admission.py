"""Admission: a completion request read, parsed once and checked, before any routing.

:func:`read_json` reads a body within the limits, decodes it (400 unless a JSON
object) and checks it against them
(:func:`~pd_orchestrator.gateway.limits.check_json`: messages, token ids, depth) --
for every route that takes a body, the tokenizer routes too. :func:`admit` then
refuses the KV-transfer fields a client may not set (400, see
:func:`refuse_transfer_fields`) and the fields only the gateway sets (400, see
:func:`refuse_gateway_fields`), parses it into its typed view (400 naming the
field), checks ``n`` times the body's size (400, ``limits.max_n_body_bytes``), checks
the model (404) and, in sidecar mode, the prefillers and the KV
source a request names in its headers (403 unless allow-listed), and returns the
request (raw body kept for pass-through, typed view for everything the gateway
reads) with the planner's view of it
(:class:`~pd_orchestrator.planner.plan.RequestFacts`). Nothing later reads the raw
body again except to forward it.
"""

from __future__ import annotations

import itertools
import re
import uuid
from collections.abc import Iterable
from typing import Any

from starlette.types import Receive

from connectors import PeerInfo
from pd_orchestrator.config.allowlist import split_host_port
from pd_orchestrator.config.settings import KvSettings, LimitsConfig
from pd_orchestrator.flows.request import ClientRequest
from pd_orchestrator.flows.sink import GatewayError
from pd_orchestrator.gateway.limits import BodyKind, check_choices, check_json, read_body
from pd_orchestrator.gateway.state import GatewayState
from pd_orchestrator.model.endpoints import Endpoint, Role
from pd_orchestrator.model.records import record
from pd_orchestrator.openai.errors import echoed
from pd_orchestrator.openai.protocol import RequestError, decode_json_object, parse_for
from pd_orchestrator.openai.responses import Kind
from pd_orchestrator.planner.choices import sidecar_order
from pd_orchestrator.planner.plan import RequestFacts
from pd_orchestrator.routing.types import PrefixFields

__all__ = [
    "GATEWAY_FIELDS",
    "TRANSFER_FIELDS",
    "TRANSFER_XARGS",
    "Admitted",
    "Body",
    "RequestIds",
    "admit",
    "header_map",
    "json_object",
    "read_json",
    "refuse_gateway_fields",
    "refuse_transfer_fields",
    "request_id_of",
    "unknown_model",
]

_REQUEST_ID = re.compile(r"[A-Za-z0-9._:\-]{1,128}")

TRANSFER_FIELDS = ("kv_transfer_params", "ec_transfer_params")
"""Body fields of vLLM 0.33's completion and chat request models that steer a KV
(or encoder-cache) transfer: the peer to pull from or push to, and a lease."""
TRANSFER_XARGS = ("kv_transfer_params", "ec_transfer_params", "kv_cache_report_mode")
"""Keys of ``vllm_xargs`` that vLLM reads as the same (``Request`` takes both
transfer params and the KV-event report mode from the sampling params' extra args)."""
_NOT_YOURS = "`{}` may not be set by a client: the gateway sets the KV transfer"
GATEWAY_FIELDS = ("cache_hit_admission_only", "cache_hit_resume_tokens")
"""Fields (in the body or ``vllm_xargs``) only the gateway sets: whether a decoder
may hand a request back is the gateway's decision (it knows what a continuation can
carry), and which prompt tokens are output a grammar must be advanced over is the
gateway's record (a client setting it could walk its own constraint's state past
what it would allow)."""
_GATEWAYS = "`{}` may not be set by a client: the gateway sets it"


@record
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


def json_object(raw: bytes) -> dict[str, Any]:
    """A request body as a JSON object; GatewayError 400 otherwise."""
    try:
        return decode_json_object(raw)
    except RequestError as exc:
        raise GatewayError(400, str(exc)) from None


@record
class Body:
    """A request body as read (``raw``, forwarded as it is where it can be) and as
    decoded and checked (``json``)."""

    raw: bytes
    json: dict[str, Any]


async def read_json(receive: Receive, limits: LimitsConfig, kind: BodyKind) -> Body:
    """The one way every route that takes a body reads and checks it: read within
    ``max_body_bytes`` (413), decoded as a JSON object (400), checked against the
    limits on messages, token ids and depth (400,
    :func:`~pd_orchestrator.gateway.limits.check_json`) before anything validates,
    re-serialises or forwards it."""
    raw = await read_body(receive, limits.max_body_bytes)
    body = json_object(raw)
    check_json(body, limits, kind)
    return Body(raw, body)


def unknown_model(model: object) -> GatewayError:
    """The 404 for a model this gateway does not serve (the name cut short)."""
    return GatewayError(404, f"The model `{echoed(model)}` does not exist.", "model")


def refuse_transfer_fields(body: dict[str, Any]) -> None:
    """400 when a client body sets a KV-transfer field (see :data:`TRANSFER_FIELDS`
    and :data:`TRANSFER_XARGS`); a null value is no setting and passes."""
    for name in TRANSFER_FIELDS:
        if body.get(name) is not None:
            raise GatewayError(400, _NOT_YOURS.format(name), name)
    xargs = body.get("vllm_xargs")
    if type(xargs) is dict:
        for key in TRANSFER_XARGS:
            if key in xargs:
                param = f"vllm_xargs.{key}"
                raise GatewayError(400, _NOT_YOURS.format(param), param)


def refuse_gateway_fields(body: dict[str, Any]) -> None:
    """400 when a client body sets a field only the gateway sets (see
    :data:`GATEWAY_FIELDS`); a null value is no setting and passes."""
    xargs = body.get("vllm_xargs")
    for name in GATEWAY_FIELDS:
        if body.get(name) is not None:
            raise GatewayError(400, _GATEWAYS.format(name), name)
        if type(xargs) is dict and xargs.get(name) is not None:
            param = f"vllm_xargs.{name}"
            raise GatewayError(400, _GATEWAYS.format(param), param)


def admit(
    state: GatewayState,
    kind: Kind,
    path: str,
    read: Body,
    headers: dict[str, str],
    arrival: float,
    ids: RequestIds,
) -> Admitted:
    """Admit one completion request, its body read by :func:`read_json` (see the
    module docstring); raises GatewayError."""
    body = read.json
    config = state.config
    if not config.security.trust_client_transfer_params:
        refuse_transfer_fields(body)
    refuse_gateway_fields(body)
    try:
        view = parse_for(kind, body)
    except RequestError as exc:
        raise GatewayError(400, str(exc), exc.param) from None
    check_choices(view.n, len(read.raw), config.limits)
    if state.models and view.model not in state.models:
        raise unknown_model(view.model)
    request = ClientRequest(
        kind=kind,
        path=path,
        body=body,
        view=view,
        request_id=request_id_of(headers.get("x-request-id"), ids),
        arrival=arrival,
        kv_source=_kv_source(state, headers),
    )
    named = _named(state, headers)
    if named is not None and state.config.sidecar.prefiller_sampling:
        named = sidecar_order(named, request.request_id)
    return Admitted(request, facts(request, state.prefix.view_fields(view), named))


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
        continuable=request.continuable,
        resumable=request.resumable,
    )


def _host_port(state: GatewayState, header: str, value: str) -> tuple[str, int]:
    """``host:port`` a header names, checked against the allow-list (400, 403)."""
    try:
        host, port = split_host_port(value)
    except ValueError:
        port = None
    if port is None:
        raise GatewayError(400, f"header {header} must name host:port")
    if state.config.sidecar.ssrf_protection and not state.allowlist.current.allows(host, port):
        raise GatewayError(403, f"{header}: '{echoed(value.strip())}' is not in the allow-list")
    return host, port


def _named(state: GatewayState, headers: dict[str, str]) -> tuple[Endpoint, ...] | None:
    """The sidecar header's prefillers (allow-listed); none (decode on the local
    decoder alone) when a sidecar's request has no such header or an empty one -- what
    llm-d's scheduler sends when it chose decode-only, and what llm-d's routing sidecar
    (llm-d-inference-scheduler v0.3, ``pkg/sidecar/proxy``) then serves on its decoder;
    None outside sidecar mode (the prefill profile ranks the fleet's prefillers)."""
    sidecar = state.config.sidecar
    if not sidecar.enabled:
        return None
    header = headers.get(sidecar.prefiller_header.lower())
    if header is None or not header.strip(" ,"):
        return ()
    chosen = [
        _prefiller(state, *_host_port(state, sidecar.prefiller_header, item))
        for item in header.split(",")
        if item.strip()
    ]
    return tuple(chosen)


def _prefiller(state: GatewayState, host: str, port: int) -> Endpoint:
    host_port = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    for endpoint in state.fleet.endpoints(Role.PREFILL):
        if endpoint.host_port == host_port:
            return endpoint
    decoder = state.fleet.endpoints(Role.DECODE)[0]
    kv = state.config.sidecar.prefiller_kv
    return Endpoint(
        name=host_port,
        url=f"http://{host_port}",
        role=Role.PREFILL,
        group=decoder.group,
        connector=decoder.connector,
        kv=None if kv is None else _peer(kv, host),
    )


def _kv_source(state: GatewayState, headers: dict[str, str]) -> PeerInfo | None:
    """The instance llm-d names as holding the prompt's prefix (P2P pulls): its host
    (allow-listed) with the side-channel ports of header-named prefillers."""
    sidecar = state.config.sidecar
    header = headers.get(sidecar.kv_source_header.lower()) if sidecar.enabled else None
    if header is None or not header.strip():
        return None
    host, _ = _host_port(state, sidecar.kv_source_header, header.split(",")[0])
    kv = sidecar.prefiller_kv
    return PeerInfo(host=host) if kv is None else _peer(kv, host)


def _peer(kv: KvSettings, host: str) -> PeerInfo:
    """``kv``'s ports at ``host`` (a header names the host)."""
    return kv.model_copy(update={"host": host}).peer(None)


def header_map(raw: Iterable[tuple[bytes, bytes]]) -> dict[str, str]:
    """ASGI headers as a dict of lower-case names (the last value of a repeated one)."""
    return {name.decode("latin-1").lower(): value.decode("latin-1") for name, value in raw}
