"""The connector protocol, its typed inputs and outputs, and the helpers adapters share.

Every adapter is pure: no I/O, no clock, no shared state, and no method mutates its
arguments (bodies, answers and contexts are read, and new objects are returned).
Bodies are copied at the top level only: the client's nested values are shared by
every leg and changed by none (a large prompt is never copied on the request path);
transfer params are always fresh.

Terms used by every module docstring:

* **prefill leg** -- the one-token, non-streamed request to the prefiller;
* **decode leg** -- the client's request to the decoder, with the transfer params;
* **transfer params** -- vLLM's top-level ``kv_transfer_params`` request/answer field;
* **context** -- a :class:`TransferContext`: the ids the executor generated for this
  hand-over and the connector-relevant addresses of both peers (:class:`PeerInfo`).

Leg orders (:class:`LegOrder`), as the flow executor must run them:

* ``SEQUENTIAL``: send the prefill leg, wait for its answer, ``read_prefill`` it, then
  send ``decode_body(body, outcome.params, ctx)``.
* ``TOGETHER``: send the prefill leg and ``decode_body(body, ahead_params(ctx), ctx)``
  at once. Hold the decode leg's answer (do not relay a byte) until the prefill leg
  has answered. Then ``read_prefill(answer, ctx)``: a failed prefill leg (HTTP error,
  connection lost) cancels the decode leg and fails or retries the hand-over; an
  outcome that is ``finished`` cancels the decode leg and serves the prefill answer;
  an outcome that is ``stale`` cancels the decode leg, drops what the executor had
  learned about the prefiller, and sends ``decode_body(body, outcome.params, ctx)``
  again (the sequential way); otherwise the held decode answer is relayed. Bound the
  wait for the prefill answer (the decoder waits for KV that may never come).

No vLLM 0.33 connector needs the decoder to be asked *before* the prefiller: the
push connectors (``NixlPushConnector``, MoRI-IO write mode) keep a finished prefill's
blocks under a lease and match the decoder's later registration, so "decode first"
is a special case of ``TOGETHER``.
"""

from __future__ import annotations

import copy
import enum
import zlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Protocol
from urllib.parse import urlsplit

__all__ = [
    "MOONCAKE_BOOTSTRAP_PORT",
    "MORIIO_HANDSHAKE_PORT",
    "MORIIO_NOTIFY_PORT",
    "NIXL_SIDE_CHANNEL_PORT",
    "P2P_SIDE_CHANNEL_PORT",
    "Body",
    "Connector",
    "ConnectorError",
    "ConnectorInfo",
    "Leg",
    "LegOrder",
    "Lookup",
    "MissingContextError",
    "Params",
    "PeerInfo",
    "PeerUpdate",
    "PrefillOutcome",
    "TransferContext",
    "UnknownConnectorError",
    "finished_naturally",
    "merge_params",
    "one_token_body",
]

Body = dict[str, Any]
Params = dict[str, Any]

# vLLM 0.33's defaults for the side channels (vllm/envs.py and the connectors' constants).
NIXL_SIDE_CHANNEL_PORT = 5600  # VLLM_NIXL_SIDE_CHANNEL_PORT
MOONCAKE_BOOTSTRAP_PORT = 8998  # VLLM_MOONCAKE_BOOTSTRAP_PORT
MORIIO_HANDSHAKE_PORT = 6301  # MoRIIOConstants.DEFAULT_HANDSHAKE_PORT
MORIIO_NOTIFY_PORT = 61005  # MoRIIOConstants.DEFAULT_NOTIFY_PORT
P2P_SIDE_CHANNEL_PORT = 5710  # VLLM_P2P_SIDE_CHANNEL_PORT (OffloadingConnector's P2P tier)


class LegOrder(enum.Enum):
    """How the executor runs the two legs; see the module docstring."""

    SEQUENTIAL = "sequential"
    TOGETHER = "together"
    PARALLEL = "together"  # alias of TOGETHER


class Leg(enum.Enum):
    """One of the two legs of a hand-over (also names the peer a lookup concerns)."""

    PREFILL = "prefill"
    DECODE = "decode"


class ConnectorError(ValueError):
    """A connector cannot be built or used as asked (composition, bad answer)."""


class UnknownConnectorError(KeyError):
    """No adapter is registered under the requested name."""


class MissingContextError(ConnectorError):
    """The adapter needs a :class:`TransferContext` (ids, peer addresses) it was not given."""


@dataclass(frozen=True, slots=True)
class PeerUpdate:
    """Facts about a peer learned at run time (from an answer or a lookup).

    ``None`` fields are unknown and leave the peer's value as it is. The executor
    keeps the last update per endpoint and forgets it when a hand-over through it
    fails or an outcome is ``stale``.
    """

    engine_id: str | None = None
    host: str | None = None
    nixl_port: int | None = None
    tp_size: int | None = None
    dp_rank: int | None = None


@dataclass(frozen=True, slots=True)
class PeerInfo:
    """The connector-relevant addresses of one vLLM instance (endpoint config).

    ``host`` is where its KV side channels listen (default: its URL's host). Ports
    are the effective ports of the engine a request lands on (vLLM adds the
    data-parallel index to the NIXL and P2P base ports). ``engine_id`` is vLLM's
    ``kv_transfer_config.engine_id`` when configured (a random id otherwise, which
    the executor may learn). ``dp_rank`` pins the data-parallel rank
    (``X-data-parallel-rank``); ``None`` lets the adapter choose one when
    ``dp_size > 1``.
    """

    host: str
    engine_id: str | None = None
    nixl_port: int = NIXL_SIDE_CHANNEL_PORT
    tp_size: int = 1
    dp_rank: int | None = None
    dp_size: int = 1
    bootstrap_port: int = MOONCAKE_BOOTSTRAP_PORT
    handshake_port: int = MORIIO_HANDSHAKE_PORT
    notify_port: int = MORIIO_NOTIFY_PORT
    p2p_port: int = P2P_SIDE_CHANNEL_PORT

    def updated(self, update: PeerUpdate | None) -> PeerInfo:
        """This peer with the known fields of ``update`` applied (self if nothing changes)."""
        if update is None:
            return self
        changes = {
            name: getattr(update, name)
            for name in PeerUpdate.__dataclass_fields__
            if getattr(update, name) is not None
        }
        return replace(self, **changes) if changes else self

    def pick_dp_rank(self, key: str) -> int:
        """The configured rank, else a stable choice from ``key`` (0 without DP)."""
        if self.dp_rank is not None:
            return self.dp_rank
        return zlib.crc32(key.encode()) % self.dp_size if self.dp_size > 1 else 0


@dataclass(frozen=True, slots=True)
class TransferContext:
    """What one hand-over needs beyond the client's body.

    ``request_id`` is the ``X-Request-Id`` value of this hand-over (an adapter that
    needs both legs to carry the same one says so through :meth:`Connector.headers`);
    ``transfer_id`` is a fresh unique id the executor generates per hand-over (never
    reused, also not across retries); ``kv_source`` is an optional third instance
    that already holds a prefix of the prompt (llm-d's ``x-kv-cache-source-host-port``).
    """

    request_id: str
    transfer_id: str
    prefiller: PeerInfo
    decoder: PeerInfo
    kv_source: PeerInfo | None = None

    def with_peer(self, leg: Leg, update: PeerUpdate | None) -> TransferContext:
        """This context with ``update`` applied to the prefiller or the decoder."""
        if leg is Leg.PREFILL:
            return replace(self, prefiller=self.prefiller.updated(update))
        return replace(self, decoder=self.decoder.updated(update))


@dataclass(frozen=True, slots=True)
class Lookup:
    """An I/O step an adapter needs before it can shape the legs.

    The executor sends ``GET url`` (JSON answer, short timeout), passes the decoded
    JSON to ``parse`` (pure; raises :class:`ConnectorError` on a bad answer), caches
    the resulting :class:`PeerUpdate` for the peer of ``leg`` and applies it with
    :meth:`TransferContext.with_peer`. A failed lookup fails the hand-over through
    that peer (try another prefiller).
    """

    leg: Leg
    url: str
    parse: Callable[[Any], PeerUpdate]


@dataclass(frozen=True, slots=True)
class PrefillOutcome:
    """What a prefill answer means for the decode leg.

    ``params`` are the ``kv_transfer_params`` to give the decoder (None when there is
    nothing to hand over: the decoder then loads what it can on its own, or
    recomputes). ``finished`` is true when the prefill answer is itself the whole
    answer (its first token ended the sequence). ``learned`` is what the answer
    taught about the prefiller (cache it for later contexts). ``stale`` is true when
    the answer contradicts the context a ``TOGETHER`` decode leg was built from.
    """

    params: Params | None
    finished: bool
    learned: PeerUpdate | None = None
    stale: bool = False


@dataclass(frozen=True, slots=True)
class ConnectorInfo:
    """What the gateway needs to know about an adapter without calling it.

    ``vllm_connectors``: the vLLM ``kv_connector`` class names it speaks.
    ``handovers``: the KV paths it can hand KV over by; a prefiller and a decoder
    can pair only through a shared one (:func:`connectors.can_pair`).
    ``leg_order``: the order with a complete context (see :meth:`Connector.order`).
    ``shared_request_id``: both legs must carry the same ``X-Request-Id``.
    ``returns_params``: the prefill answer carries ``kv_transfer_params``.
    ``peer_fields``: the :class:`PeerInfo` fields it reads (for configuration).
    ``prefill_keys``/``decode_keys``: the ``kv_transfer_params`` keys it writes.
    ``address_keys``: the keys of the params handed to the decoder that name a host
    the decoder will connect to (a host, or a URL whose host counts): what
    :func:`named_hosts` reads, so that a gateway can check them.
    """

    name: str
    vllm_connectors: tuple[str, ...]
    handovers: frozenset[str]
    leg_order: LegOrder
    shared_request_id: bool = False
    returns_params: bool = False
    peer_fields: frozenset[str] = frozenset()
    prefill_keys: frozenset[str] = frozenset()
    decode_keys: frozenset[str] = frozenset()
    address_keys: frozenset[str] = frozenset()
    children: tuple[ConnectorInfo, ...] = field(default=())


class Connector(Protocol):
    """A KV-connector adapter. Every method is pure and never mutates its input.

    ``ctx`` is optional where the existing NIXL and shared-storage flows need none;
    adapters that need it raise :class:`MissingContextError` without it.
    """

    name: str
    leg_order: LegOrder

    def describe(self) -> ConnectorInfo:
        """The static facts about this adapter."""
        ...

    def order(self, ctx: TransferContext | None = None) -> LegOrder:
        """The leg order for this hand-over (may depend on what ``ctx`` knows)."""
        ...

    def lookups(self, ctx: TransferContext) -> tuple[Lookup, ...]:
        """The lookups still needed before the legs can be shaped (usually none)."""
        ...

    def headers(self, leg: Leg, ctx: TransferContext) -> dict[str, str]:
        """Headers ``leg`` must carry (they override the executor's own)."""
        ...

    def prefill_body(self, body: Body, ctx: TransferContext | None = None) -> Body:
        """The body to send to the prefiller for a client body ``body``."""
        ...

    def read_prefill(self, answer: Body, ctx: TransferContext | None = None) -> PrefillOutcome:
        """Interpret the prefiller's (non-streamed) answer."""
        ...

    def ahead_params(self, ctx: TransferContext) -> Params:
        """The decode leg's params before the prefill answers (``TOGETHER`` only)."""
        ...

    def decode_body(
        self, body: Body, params: Params | None, ctx: TransferContext | None = None
    ) -> Body:
        """The body to send to the decoder with the transfer params ``params``."""
        ...


def one_token_body(body: Body) -> Body:
    """A copy of ``body`` turned into a one-token, non-streamed request.

    ``max_tokens`` (and ``max_completion_tokens`` if present) become 1,
    ``stream_options`` goes, ``min_tokens`` is capped at 1 and the cache-hit
    threshold is dropped (prefill requests ignore it anyway). The copy is shallow:
    only top-level fields change, and the client's nested values (messages, tools,
    a prompt of any size) are shared, never copied and never changed.
    """
    out = dict(body)
    out["stream"] = False
    out.pop("stream_options", None)
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    if "min_tokens" in out:
        out["min_tokens"] = min(1, int(out["min_tokens"] or 0))
    out.pop("cache_hit_threshold", None)
    return out


def finished_naturally(answer: Body) -> bool:
    """Whether a one-token answer ended the sequence (stop, not length)."""
    choices = answer.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return False
    return choices[0].get("finish_reason") == "stop"


def answer_params(answer: Body) -> Params | None:
    """A copy of the answer's ``kv_transfer_params`` when it is a non-empty object."""
    params = answer.get("kv_transfer_params")
    return copy.deepcopy(params) if isinstance(params, dict) and params else None


def named_hosts(info: ConnectorInfo, params: Mapping[str, Any] | None) -> tuple[str, ...]:
    """The hosts ``params`` (handed to a decoder) name under ``info.address_keys``,
    lower-cased, IPv6 without brackets; :class:`ConnectorError` for a value that is
    not a string or names no host."""
    if not params:
        return ()
    hosts: list[str] = []
    for key in info.address_keys:
        value = params.get(key)
        if value is None:
            continue
        if not isinstance(value, str):
            raise ConnectorError(f"{key} is not a string")
        host = urlsplit(value).hostname if "://" in value else value.strip("[]")
        if not host:
            raise ConnectorError(f"{key} names no host")
        hosts.append(host.lower())
    return tuple(hosts)


def with_params(body: Body, params: Mapping[str, Any] | None) -> Body:
    """A copy of ``body`` (shallow, as :func:`one_token_body`) whose
    ``kv_transfer_params`` is a copy of ``params`` (absent if None)."""
    out = dict(body)
    if params is None:
        out.pop("kv_transfer_params", None)
    else:
        out["kv_transfer_params"] = copy.deepcopy(dict(params))
    return out


def merge_params(parts: list[Params | None]) -> Params | None:
    """One params dict from several (vLLM's MultiConnector merges them the same way).

    A key given twice must have the same value (else :class:`ConnectorError`, as
    vLLM raises on a key clash); None parts are skipped; None if all are None.
    """
    merged: Params | None = None
    for part in parts:
        if part is None:
            continue
        if merged is None:
            merged = {}
        for key, value in part.items():
            if key in merged and merged[key] != value:
                raise ConnectorError(f"kv_transfer_params key clash on {key!r}")
            merged[key] = copy.deepcopy(value)
    return merged


def require_ctx(ctx: TransferContext | None, name: str) -> TransferContext:
    """``ctx``, or :class:`MissingContextError` naming the adapter."""
    if ctx is None:
        raise MissingContextError(
            f"connector {name!r} needs a TransferContext (ids and peer addresses)"
        )
    return ctx


class Adapter(ABC):
    """Shared shape of the adapters: bodies from params, and neutral defaults.

    Subclasses set ``name``, ``leg_order`` and implement :meth:`prefill_params`,
    :meth:`read_prefill` and :meth:`describe`; the rest has defaults.
    """

    name: str
    leg_order: LegOrder

    @abstractmethod
    def describe(self) -> ConnectorInfo: ...

    def order(self, ctx: TransferContext | None = None) -> LegOrder:
        return self.leg_order

    def lookups(self, ctx: TransferContext) -> tuple[Lookup, ...]:
        return ()

    def headers(self, leg: Leg, ctx: TransferContext) -> dict[str, str]:
        return {}

    @abstractmethod
    def prefill_params(self, ctx: TransferContext | None) -> Params | None:
        """The prefill leg's ``kv_transfer_params`` (None: the field is removed)."""

    def prefill_body(self, body: Body, ctx: TransferContext | None = None) -> Body:
        out = one_token_body(body)
        params = self.prefill_params(ctx)
        if params is None:
            out.pop("kv_transfer_params", None)
        else:
            out["kv_transfer_params"] = params
        return out

    @abstractmethod
    def read_prefill(self, answer: Body, ctx: TransferContext | None = None) -> PrefillOutcome:
        """What the prefill's answer says: the decode leg's params, or a finished answer."""

    def ahead_params(self, ctx: TransferContext) -> Params:
        raise ConnectorError(f"connector {self.name!r} does not run its legs together")

    def decode_body(
        self, body: Body, params: Params | None, ctx: TransferContext | None = None
    ) -> Body:
        return with_params(body, params)
