"""The configuration schema (version 1).

Every model forbids unknown keys, so a typo is an error that names the key.
Values come from the YAML file first, then ``PDO_`` environment variables
(nested keys joined with ``__``, e.g. ``PDO_THRESHOLD__POLICY__VALUE=0.8``;
lists as JSON) override them.
"""

from __future__ import annotations

from dataclasses import field
from pathlib import Path
from typing import Annotated, Any, Literal, Self
from urllib.parse import urlsplit

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from connectors import (
    MOONCAKE_BOOTSTRAP_PORT,
    MORIIO_HANDSHAKE_PORT,
    MORIIO_NOTIFY_PORT,
    NIXL_SIDE_CHANNEL_PORT,
    P2P_SIDE_CHANNEL_PORT,
    ConnectorError,
    PeerInfo,
    UnknownConnectorError,
    can_pair,
    get_connector,
)
from pd_orchestrator.config.allowlist import parse_entries
from pd_orchestrator.config.load import LoadConfig
from pd_orchestrator.config.observability import AuthConfig, LoggingConfig, TracingConfig
from pd_orchestrator.config.policy import ThresholdConfig
from pd_orchestrator.config.prefix import PrefixConfig
from pd_orchestrator.config.routing import RoutingConfig
from pd_orchestrator.model.compatibility import kv_may_move
from pd_orchestrator.model.records import record

__all__ = [
    "AdaptiveWidthConfig",
    "AdminConfig",
    "AskAllConfig",
    "AskAllFallbackConfig",
    "AuthConfig",
    "CompatibilityConfig",
    "ConnectorBridge",
    "EndpointConfig",
    "FleetEndpoint",
    "GatewayConfig",
    "HandbackConfig",
    "HealthConfig",
    "HostStagedPair",
    "KvSettings",
    "LifecycleConfig",
    "LimitsConfig",
    "ListenConfig",
    "LoggingConfig",
    "OutlierConfig",
    "PoolConfig",
    "SecurityConfig",
    "SidecarConfig",
    "SimSpec",
    "ThresholdConfig",
    "TimeoutConfig",
    "TracingConfig",
    "UpstreamConfig",
]

Ratio = Annotated[float, Field(ge=0.0, le=1.0)]
Seconds = Annotated[float, Field(gt=0.0)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ListenConfig(_Strict):
    """Where the gateway listens; ``workers`` > 1 runs that many gateway processes on
    the port (``SO_REUSEPORT``), each with its own state (see ``pd_orchestrator.cli.
    workers``); ``worker_metrics_port`` P: worker *i* also serves on P + *i*.
    ``probe_port``: a second port on ``host`` that answers only ``/health``,
    ``/ready`` and ``/metrics``, on connections counted apart from the main port's
    ``limits.max_connections`` (point liveness and readiness probes there, and keep
    it off the client-facing Service)."""

    host: str = "127.0.0.1"
    port: Annotated[int, Field(ge=0, le=65535)] = 8000
    workers: Annotated[int, Field(ge=1, le=64)] = 1
    worker_metrics_port: Annotated[int, Field(ge=1, le=65535)] | None = None
    probe_port: Annotated[int, Field(ge=1, le=65535)] | None = None


class SimSpec(_Strict):
    """How ``pd-orchestrator up`` simulates an endpoint that has no URL."""

    profile: str = "h200-llama3-8b"
    time_scale: Annotated[float, Field(ge=0.0)] = 1.0
    block_size: Annotated[int, Field(ge=1)] = 16
    num_kv_blocks: Annotated[int, Field(ge=1)] | None = None
    max_num_seqs: Annotated[int, Field(ge=1)] = 256
    port: Annotated[int, Field(ge=0, le=65535)] = 0
    seed: int = 0
    extra_args: list[str] = Field(default_factory=list)

    @field_validator("profile")
    @classmethod
    def _known_profile(cls, value: str) -> str:
        return _profile_spec(value)


def _profile_spec(value: str) -> str:
    """``value`` when it names a built-in simulator profile or a readable profile file
    (``pd-orchestrator profile``'s); else ``ValueError`` saying why."""
    from pd_orchestrator.model.measured import resolve_profile

    try:
        resolve_profile(value)
    except KeyError as exc:
        raise ValueError(str(exc.args[0])) from None
    return value


Name = Annotated[str, Field(min_length=1, pattern=r"^[A-Za-z0-9_.\-]+$")]
RoleName = Literal["decode", "prefill", "both"]
Port = Annotated[int, Field(ge=1, le=65535)]


def _connector_spec(value: str) -> str:
    try:
        get_connector(value)  # builds it: a multi's children must compose
    except (UnknownConnectorError, ConnectorError) as exc:
        raise ValueError(str(exc.args[0])) from None
    return value


ConnectorName = Annotated[str, AfterValidator(_connector_spec)]
"""A connector spec: ``nixl``, ``nixl-push``, ``mooncake``, ``moriio``, ``offloading``,
``lmcache``, ``example`` or ``multi:A,B`` (see the ``connectors`` package)."""


class KvSettings(_Strict):
    """Where an instance's KV side channels listen, for the connectors that name a peer.

    Defaults are vLLM 0.33's. ``host``: default the URL's host (set it when
    ``VLLM_NIXL_SIDE_CHANNEL_HOST`` and friends advertise another address).
    ``engine_id``: vLLM's ``kv_transfer_config.engine_id`` when it is set (lets
    ``nixl-push`` run its legs together and spares ``mooncake`` its ``/query``).
    Ports are the ones the engine a request lands on binds: ``nixl_port``
    (``VLLM_NIXL_SIDE_CHANNEL_PORT``, plus the data-parallel index),
    ``bootstrap_port`` (Mooncake's ``VLLM_MOONCAKE_BOOTSTRAP_PORT``),
    ``handshake_port``/``notify_port`` (MoRI-IO's ``kv_connector_extra_config``),
    ``p2p_port`` (the OffloadingConnector P2P tier's ``VLLM_P2P_SIDE_CHANNEL_PORT``).
    ``dp_rank`` pins the data-parallel rank of a ``dp_size`` > 1 instance (default:
    the connector picks one per request).
    """

    host: str | None = None
    engine_id: str | None = None
    nixl_port: Port = NIXL_SIDE_CHANNEL_PORT
    bootstrap_port: Port = MOONCAKE_BOOTSTRAP_PORT
    handshake_port: Port = MORIIO_HANDSHAKE_PORT
    notify_port: Port = MORIIO_NOTIFY_PORT
    p2p_port: Port = P2P_SIDE_CHANNEL_PORT
    tp_size: Annotated[int, Field(ge=1)] = 1
    dp_size: Annotated[int, Field(ge=1)] = 1
    dp_rank: Annotated[int, Field(ge=0)] | None = None

    @model_validator(mode="after")
    def _rank_in_range(self) -> Self:
        if self.dp_rank is not None and self.dp_rank >= self.dp_size:
            raise ValueError(f"dp_rank {self.dp_rank} is not below dp_size {self.dp_size}")
        return self

    def peer(self, url: str | None) -> PeerInfo:
        """These settings as the connectors' :class:`~connectors.PeerInfo`."""
        host = self.host or (urlsplit(url).hostname if url else None) or "127.0.0.1"
        fields = self.model_dump(exclude={"host"})
        return PeerInfo(host=host, **fields)


class EndpointConfig(_Strict):
    """One vLLM instance of a pool. ``url`` may be omitted when a ``sim`` block (its
    own or the pool's) says how ``pd-orchestrator up`` simulates it. ``hardware``
    and ``model`` default to the pool's."""

    name: Name
    url: str | None = None
    hardware: str | None = None
    model: str | None = None
    sim: SimSpec | None = None
    kv: KvSettings | None = Field(default=None, description="default: the pool's")

    @field_validator("url")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        if value is None:
            return None
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{value!r} is not an http(s) URL with a host")
        return value.rstrip("/")


class PoolConfig(_Strict):
    """Endpoints of one hardware kind and role, and the compatibility group their KV
    belongs to (default: the hardware label). KV moves only between a prefiller and
    a decoder of one group that use the same connector, unless the pair of groups is
    declared host-staged."""

    name: Name
    hardware: str = "unknown"
    role: RoleName
    model: str | None = None
    connector: ConnectorName | None = Field(
        default=None, description="default: the top-level connector"
    )
    group: str | None = Field(default=None, description="default: the hardware label")
    sim: SimSpec | None = Field(default=None, description="default sim block of the endpoints")
    kv: KvSettings | None = Field(default=None, description="default kv block of the endpoints")
    api_key: SecretStr | None = Field(
        default=None,
        description="bearer key sent to this pool's endpoints instead of the client's "
        "Authorization (default: upstream.api_key)",
    )
    profile: str | None = Field(
        default=None,
        description="the latency profile the goodput policy starts from: a profile file "
        "`pd-orchestrator profile` measured on these endpoints, or the name of a built-in "
        "simulator profile (for simulators only); default: the profile of the `sim` block an "
        "endpoint is started from, else none (conservative seeds, learnt from traffic)",
    )
    spill: bool = Field(
        default=False,
        description="a prefill pool whose instances also serve whole requests (their "
        "connector serves their own requests too, such as NIXL with kv_role kv_both): "
        "the goodput policy may send a decode-first request here when its decoder is "
        "crowded or queued",
    )
    endpoints: Annotated[list[EndpointConfig], Field(min_length=1)]

    @field_validator("profile")
    @classmethod
    def _known_pool_profile(cls, value: str | None) -> str | None:
        return None if value is None else _profile_spec(value)

    @model_validator(mode="after")
    def _spill_prefills_only(self) -> Self:
        if self.spill and self.role != "prefill":
            raise ValueError(
                f"pool {self.name!r}: spill is for a prefill pool (a {self.role} pool "
                "already decodes)"
            )
        return self

    @model_validator(mode="after")
    def _url_or_sim(self) -> Self:
        for endpoint in self.endpoints:
            if endpoint.url is None and endpoint.sim is None and self.sim is None:
                raise ValueError(
                    f"endpoint {endpoint.name!r} needs a url (or a sim block for `up`)"
                )
        return self

    @property
    def compatibility_group(self) -> str:
        return self.group or self.hardware


class HostStagedPair(_Strict):
    """A prefill group whose KV may reach a decode group by staging through host memory."""

    prefill_group: str
    decode_group: str


class ConnectorBridge(_Strict):
    """Prefillers of one connector may hand KV to decoders of another (the decoder's
    adapter shapes both legs); only connectors with a common KV path can be bridged,
    such as ``nixl`` and ``multi:nixl,offloading``."""

    prefill_connector: ConnectorName
    decode_connector: ConnectorName

    @model_validator(mode="after")
    def _can_pair(self) -> Self:
        if not can_pair(self.prefill_connector, self.decode_connector):
            raise ValueError(
                f"{self.prefill_connector} cannot hand KV over to {self.decode_connector} "
                "(no KV path in common)"
            )
        return self


class CompatibilityConfig(_Strict):
    """Which prefillers may hand KV to which decoders beyond the same group and connector."""

    host_staged: list[HostStagedPair] = Field(default_factory=list)
    connector_bridges: list[ConnectorBridge] = Field(default_factory=list)

    def group_pairs(self) -> frozenset[tuple[str, str]]:
        """The host-staged ``(prefill group, decode group)`` pairs."""
        return frozenset((p.prefill_group, p.decode_group) for p in self.host_staged)

    def connector_pairs(self) -> frozenset[tuple[str, str]]:
        """The bridged ``(prefill connector, decode connector)`` pairs."""
        return frozenset((b.prefill_connector, b.decode_connector) for b in self.connector_bridges)


@record
class FleetEndpoint:
    """An endpoint with everything its pool says about it (resolved defaults)."""

    name: str
    url: str | None
    role: RoleName
    hardware: str
    model: str | None
    pool: str
    group: str
    connector: ConnectorName
    sim: SimSpec | None
    kv: KvSettings = field(default_factory=KvSettings)
    api_key: SecretStr | None = field(default=None, repr=False)
    spill: bool = False
    profile: str | None = None

    @property
    def peer(self) -> PeerInfo:
        """The connector-relevant addresses of this endpoint."""
        return self.kv.peer(self.url)

    @property
    def decodes(self) -> bool:
        return self.role in ("decode", "both")

    @property
    def prefills(self) -> bool:
        return self.role in ("prefill", "both")


def _legacy_pools(data: dict[str, Any]) -> dict[str, Any]:
    """Turn the v1 ``decoders``/``prefillers`` lists into pools of the same names."""
    pools = list(data.get("pools") or [])
    for key, role in (("decoders", "decode"), ("prefillers", "prefill")):
        endpoints = data.pop(key, None)
        if endpoints:
            pools.append({"name": key, "role": role, "group": "default", "endpoints": endpoints})
    if pools:
        data["pools"] = pools
    return data


class TimeoutConfig(_Strict):
    """Per-phase upstream timeouts, in seconds."""

    connect: Seconds = 2.0
    decode_attempt: Seconds = Field(
        default=30.0, description="until the decoder's first decisive answer"
    )
    prefill: Seconds = 60.0
    decode: Seconds = Field(default=120.0, description="between two chunks of a decode leg")
    pool: Seconds = 5.0
    per_1k_prompt_tokens: Annotated[float, Field(ge=0.0, allow_inf_nan=False)] = Field(
        default=0.5,
        description="added to each read timeout of a request's legs per 1,000 tokens of its "
        "prompt (estimated; rounded up to a whole second): prefilling a long prompt takes "
        "time, and a timeout that its size causes is not the endpoint's fault",
    )


class HandbackConfig(_Strict):
    """Preempted requests handed back mid-generation (RFC 24256 phase 2)."""

    max_handbacks: Annotated[int, Field(ge=0)] = 2
    leg_threshold: Ratio = Field(
        default=0.0,
        description="threshold sent on decode legs that follow a prefill; 0 lets the "
        "decoder recompute after a preemption instead of handing back again",
    )
    max_recoveries: Annotated[int, Field(ge=0)] = Field(
        default=1,
        description="decode legs whose connection breaks mid-stream that are continued "
        "on another decoder (prompt plus generated tokens) instead of failing the stream",
    )


class SidecarConfig(_Strict):
    """Sidecar mode: one local decoder; the prefiller (and a KV source) may come from
    headers an upstream scheduler sets (llm-d's names by default). Every host a
    header names must be in the allow-list (``allowed_prefillers`` and the lines of
    ``allowlist_file``: ``host:port``, ``host``, a network, or a DNS name resolved
    every ``allowlist_refresh`` seconds), else 403 -- unless ``ssrf_protection`` is
    off, which accepts any host (llm-d's ``--enable-ssrf-protection=false``).
    ``prefiller_sampling``: spread requests over the prefillers a header names
    (default: the first, the others as retries). ``prefiller_kv``: the side-channel
    ports of header-named prefillers (vLLM's defaults). ``max_named_targets``: how
    many header-named ``host:port`` targets keep state of their own (health,
    outlier counts, pooled connections: the least recently used idle one is
    forgotten past it) and their own ``upstream`` label in the metrics (later ones
    are counted as ``upstream="other"``)."""

    enabled: bool = False
    prefiller_header: str = "x-prefiller-host-port"
    kv_source_header: str = "x-kv-cache-source-host-port"
    ssrf_protection: bool = True
    allowed_prefillers: list[str] = Field(
        default_factory=list, description="hosts, host:port, networks or DNS names"
    )
    allowlist_file: Path | None = None
    allowlist_refresh: Seconds = 10.0
    prefiller_sampling: bool = False
    prefiller_kv: KvSettings | None = None
    max_named_targets: Annotated[int, Field(ge=1)] = 256

    @field_validator("allowed_prefillers")
    @classmethod
    def _entries(cls, values: list[str]) -> list[str]:
        parse_entries(values)  # ValueError names the bad entry
        return values

    @field_validator("allowlist_file")
    @classmethod
    def _readable(cls, value: Path | None) -> Path | None:
        if value is not None:
            parse_entries(value.read_text().splitlines())
        return value


MIB = 1 << 20
KIB = 1 << 10


class UpstreamConfig(_Strict):
    """The HTTP client towards vLLM instances (limits are per endpoint)."""

    max_connections: Annotated[int, Field(ge=1)] = Field(
        default=1024, description="open connections per endpoint"
    )
    max_keepalive_connections: Annotated[int, Field(ge=0)] = Field(
        default=256, description="idle connections kept per endpoint"
    )
    keepalive_expiry: Seconds = Field(
        default=4.0,
        description="idle connections are dropped after this; keep it below the upstream "
        "servers' keep-alive timeout (uvicorn, so vLLM: 5 s)",
    )
    max_line_bytes: Annotated[int, Field(ge=64 * KIB)] = Field(
        default=16 * MIB,
        description="longest server-sent event an endpoint may stream (a longer one is the "
        "endpoint's protocol error); 16 MiB holds a first chunk with a 1M-token prompt's ids",
    )
    prefill_attempts: Annotated[int, Field(ge=1, le=10)] = Field(
        default=3, description="prefill attempts per hand-over, each on another prefiller"
    )
    retry_backoff: Annotated[float, Field(ge=0.0)] = Field(
        default=0.05,
        description="base of the jittered exponential backoff between prefill attempts",
    )
    prefill_budget: Seconds = Field(
        default=60.0, description="seconds all prefill attempts of one hand-over may take"
    )
    api_key: SecretStr | None = Field(
        default=None,
        description="bearer key sent to every endpoint instead of the client's "
        "Authorization (PDO_UPSTREAM__API_KEY); a pool's api_key wins",
    )
    prefill_fallback: Literal["local", "error"] = Field(
        default="local",
        description="when every prefill attempt of a hand-over failed on the prefill side, "
        "or no prefiller can reach the decoder: `local` sends the request to the decoder "
        "with threshold 0 (it prefills itself), `error` answers the failure (503)",
    )
    decode_attempts: Annotated[int, Field(ge=1, le=10)] = Field(
        default=3,
        description="decoders tried, one after another, for a request whose decoder fails "
        "(refused, broken, timed out or 5xx) before anything reached the client",
    )


class HealthConfig(_Strict):
    """Active health checks of every endpoint (``GET /health``)."""

    interval: Seconds = 2.0
    timeout: Seconds = 1.0
    unhealthy_after: Annotated[int, Field(ge=1)] = 2


class SharedStateConfig(_Strict):
    """What several gateways in front of one fleet share through a NATS server: each
    publishes the requests it has in flight and the prompt tokens it has queued per
    endpoint, and the prefill tokens each ``goodput`` policy kept per decoder; each
    adds what the others published to its own. Off (``url`` None) for a single
    gateway. Unreachable, a gateway counts its own state alone, never waits for it,
    and says so in ``/status``."""

    url: str | None = Field(
        default=None, description="the NATS server, nats://HOST:PORT (None: nothing shared)"
    )
    subject: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,128}$")] = Field(
        default="pd-orchestrator.load",
        description="the subject the gateways of one fleet publish on",
    )
    interval: Annotated[float, Field(gt=0.0, le=5.0)] = Field(
        default=0.05, description="seconds between two reports of this gateway"
    )
    ttl: Annotated[float, Field(gt=0.0, le=60.0)] = Field(
        default=1.0, description="seconds after which a silent gateway's report is dropped"
    )

    @field_validator("url")
    @classmethod
    def _nats_url(cls, value: str | None) -> str | None:
        if value is None:
            return None
        parts = urlsplit(value)
        if parts.scheme not in ("nats", "tls") or not parts.hostname or parts.path not in ("", "/"):
            raise ValueError(f"expected nats://HOST:PORT, got {value!r}")
        return value

    @model_validator(mode="after")
    def _ttl_over_interval(self) -> Self:
        if self.ttl < 2 * self.interval:
            raise ValueError("ttl must be at least twice the interval")
        return self


class OutlierConfig(_Strict):
    """Passive ejection of endpoints that keep failing real requests (Envoy's outlier
    detection; see ``pd_orchestrator.fleet.outliers``). 0 turns a counter off."""

    consecutive_5xx: Annotated[int, Field(ge=0)] = Field(
        default=5, description="HTTP 5xx answers in a row that eject an endpoint"
    )
    consecutive_failures: Annotated[int, Field(ge=0)] = Field(
        default=5,
        description="connection failures in a row (refused, broken, timed out) that eject it",
    )
    base_ejection_time: Seconds = Field(
        default=30.0, description="seconds out, times the number of times ejected"
    )
    max_ejection_time: Seconds = Field(default=300.0, description="the longest ejection")
    max_ejection_percent: Annotated[float, Field(ge=0.0, le=100.0)] = Field(
        default=10.0,
        description="of a role's endpoints at most this share is ejected at once (at least "
        "one may be, never the last one in routing)",
    )


class LifecycleConfig(_Strict):
    """Start and stop. On SIGTERM (or SIGINT) the gateway drains: ``/ready`` answers
    503, the listening socket closes, requests in flight may finish for
    ``drain_seconds``; then each stream still open ends with an error event and
    ``[DONE]``, and each whole answer still pending is a 503."""

    drain_seconds: Annotated[float, Field(ge=0.0)] = Field(
        default=120.0, description="how long requests in flight may finish after SIGTERM"
    )


class AdminConfig(_Strict):
    """The admin API (``POST /admin/reload``): off unless a bearer token is set
    (``PDO_ADMIN__TOKEN`` keeps it out of the file). Requests must carry
    ``Authorization: Bearer <token>``. An empty token (``PDO_ADMIN__TOKEN=``) is an
    error, not an open door: leave the key unset to turn the API off."""

    token: SecretStr | None = None

    @field_validator("token")
    @classmethod
    def _usable_token(cls, value: SecretStr | None) -> SecretStr | None:
        if value is None:
            return None
        secret = value.get_secret_value()
        if not secret:
            raise ValueError("the admin token is empty (unset it to turn the admin API off)")
        if not all("!" <= char <= "~" for char in secret):
            raise ValueError("the admin token must be printable ASCII without spaces")
        return value


class LimitsConfig(_Strict):
    """Limits on what a client may send, each checked before the work it protects
    and answered in the OpenAI error shape.

    ``max_body_bytes`` (413): a request body, refused from its ``Content-Length``
    before a byte is read, or as soon as a chunked body passes it (never buffered
    beyond). 16 MiB holds a 1M-token prompt as text or as token ids, or a few
    images as data URLs; parsing costs about 4 ms per MiB of text and up to
    60 ms per MiB of tiny JSON objects. ``max_header_bytes`` and ``max_headers``
    (431): the request line and headers (names plus values), counted while they
    arrive (Envoy's defaults are 60 KiB and 100). ``max_json_depth`` (400): nesting
    of the JSON body (the JSON encoder stops at 254 levels, hence the ceiling).
    ``max_messages`` and ``max_prompt_token_ids`` (400): checked before the body is
    validated, whose cost grows with them (about 7 us per chat message).
    ``max_n_body_bytes`` (400): ``n`` times the body's bytes, for ``n`` > 1 (each
    choice is a request of its own upstream).

    What a connection may hold: ``header_timeout`` (the request head, from the
    connection's opening or the request's first byte) and ``body_timeout`` (the
    whole body, from the end of the head) answer 408 and close the connection;
    ``keepalive_timeout`` closes a connection idle between two requests;
    ``max_connections`` (per process; default: half the open-file limit) and
    ``max_connection_share`` (of ``max_connections``, per client address): a
    connection past either closes the longest idle connection first (the client's
    own, past its share), and is answered 503 and closed when none is idle. Behind
    a proxy every client shares the proxy's address: raise the share to 1.0 there.
    ``max_concurrent_choices`` (default: one per 64 open files, 4 to 32): how many
    of a request's ``n`` choices run upstream at once; the others wait their turn,
    so one request holds a bounded number of upstream connections.
    """

    max_body_bytes: Annotated[int, Field(ge=KIB)] = 16 * MIB
    max_header_bytes: Annotated[int, Field(ge=KIB)] = 64 * KIB
    max_headers: Annotated[int, Field(ge=8)] = 100
    max_json_depth: Annotated[int, Field(ge=4, le=200)] = 64
    max_messages: Annotated[int, Field(ge=1)] = 4096
    max_prompt_token_ids: Annotated[int, Field(ge=1)] = MIB
    max_n_body_bytes: Annotated[int, Field(ge=KIB)] = 32 * MIB
    header_timeout: Seconds = 10.0
    body_timeout: Seconds = 30.0
    keepalive_timeout: Seconds = 5.0
    max_connections: Annotated[int, Field(ge=1)] | None = None
    max_connection_share: Annotated[float, Field(gt=0.0, le=1.0)] = 0.5
    max_concurrent_choices: Annotated[int, Field(ge=1)] | None = None


class SecurityConfig(_Strict):
    """What the gateway lets clients steer.

    ``trust_client_transfer_params``: the KV-transfer fields of vLLM's request
    models -- ``kv_transfer_params``, ``ec_transfer_params`` and the same keys (and
    ``kv_cache_report_mode``) inside ``vllm_xargs`` -- tell an engine which host to
    pull KV from or push it to, and make it hold KV for a lease. They are the
    gateway's to set: a client body carrying one is refused (400) unless this is
    true, for a trusted caller such as an llm-d scheduler that sets them itself.
    """

    trust_client_transfer_params: bool = False


class AskAllFallbackConfig(_Strict):
    """What happens when every asked decoder rejects.

    ``pick``: the decoder that takes the request -- ``least-loaded`` (fewest running
    plus waiting, then fewest in flight), ``most-free-kv`` (lowest KV usage) or
    ``hardware-weight`` (highest weight in ``hardware_weights``, default 1.0).
    ``then``: ``pd`` prefills on a compatible prefiller; ``local`` sends the request
    to that decoder with threshold 0 (it prefills itself). ``holder_slack`` (with
    ``width: adaptive``): a decoder seen holding part of the prompt takes it if it has
    at most this many requests more than the least loaded (``least-loaded``; the other
    picks prefer such a decoder among equals only).
    """

    pick: Literal["least-loaded", "most-free-kv", "hardware-weight"] = "least-loaded"
    then: Literal["pd", "local"] = "pd"
    holder_slack: Annotated[int, Field(ge=0)] = 2
    hardware_weights: dict[str, Annotated[float, Field(ge=0.0)]] = Field(default_factory=dict)


class AdaptiveWidthConfig(_Strict):
    """How ``width: adaptive`` finds the decoders likely to hold a prompt
    (:mod:`pd_orchestrator.planner.width`).

    The gateway remembers, per decoder, the leading blocks of the prompts it served
    (``block_tokens`` token ids per block when the prompt is known as ids, else
    ``chunk_chars`` characters per block; at most ``max_blocks`` per prompt and
    ``capacity_per_endpoint`` per decoder, least recently served evicted first). A
    request asks the decoders whose remembered prefix covers the threshold less one
    block. A decoder the gateway has known for less than ``warmup`` seconds (at
    start, or after it joined) is asked whatever the evidence, since its cache may
    hold what this gateway never routed to it; and one request in ``explore_every``
    with no likely holder asks ``explore_width`` decoders (0: every decoder), the next
    ones at each turn, which finds what the memory missed (other gateway replicas,
    evictions); ``explore_every: 0`` turns exploring off.
    """

    block_tokens: Annotated[int, Field(ge=1)] = 64
    chunk_chars: Annotated[int, Field(ge=1)] = 256
    max_blocks: Annotated[int, Field(ge=1)] = 1024
    capacity_per_endpoint: Annotated[int, Field(ge=1)] = 65_536
    warmup: Annotated[float, Field(ge=0.0, allow_inf_nan=False)] = 30.0
    explore_every: Annotated[int, Field(ge=0)] = 64
    explore_width: Annotated[int, Field(ge=0)] = 4


class AskAllConfig(_Strict):
    """The "ask all K instances" mode of RFC 24256.

    ``width``: how many decoders to ask -- ``all``, the top K of the decode profile's
    ranking, or ``adaptive``: only the decoders likely to hold enough of the prompt
    (``adaptive`` settings), none when no decoder is (the request goes straight to
    P/D on the fallback decoder), and one when the threshold is 0 (every decoder
    admits). ``variant``: ``race`` sends the real request to all of them at
    once, the first decoder to admit serves and the others are cancelled; ``probe``
    first sends one-token probes, then the real request to the admitting decoder with
    the most cached tokens.

    ``tokenize_from``: when a request asks at least this many decoders, its prompt is
    tokenized once (one ``/tokenize`` on one of the asked decoders, or the ids the
    gateway already has) and every leg of the request sends the token ids on
    ``/v1/completions``, so no asked decoder tokenizes it again; the answer is
    re-rendered in the client's API (see
    :attr:`~pd_orchestrator.flows.request.ClientRequest.tokenizable` for the requests
    that keep their text). ``null``: prompts always go as the client sent them.
    ``tokenize_timeout``: a ``/tokenize`` that takes longer is abandoned (the request
    goes as text).
    """

    width: Literal["all", "adaptive"] | Annotated[int, Field(ge=1)] = "all"
    adaptive: AdaptiveWidthConfig = Field(default_factory=AdaptiveWidthConfig)
    variant: Literal["race", "probe"] = "race"
    fallback: AskAllFallbackConfig = Field(default_factory=AskAllFallbackConfig)
    tokenize_from: Annotated[int, Field(ge=1)] | None = 2
    tokenize_timeout: Seconds = 2.0


class GatewayConfig(BaseSettings):
    """The whole gateway configuration."""

    model_config = SettingsConfigDict(
        env_prefix="PDO_",
        env_nested_delimiter="__",
        extra="forbid",
        frozen=True,
    )

    version: Literal[1] = 1
    listen: ListenConfig = Field(default_factory=ListenConfig)
    pools: list[PoolConfig] = Field(default_factory=list)
    compatibility: CompatibilityConfig = Field(default_factory=CompatibilityConfig)
    connector: ConnectorName = "nixl"
    threshold: ThresholdConfig = Field(default_factory=ThresholdConfig)
    timeouts: TimeoutConfig = Field(default_factory=TimeoutConfig)
    handback: HandbackConfig = Field(default_factory=HandbackConfig)
    sidecar: SidecarConfig = Field(default_factory=SidecarConfig)
    upstream: UpstreamConfig = Field(default_factory=UpstreamConfig)
    health: HealthConfig = Field(default_factory=HealthConfig)
    outlier: OutlierConfig = Field(default_factory=OutlierConfig)
    shared_state: SharedStateConfig = Field(default_factory=SharedStateConfig)
    lifecycle: LifecycleConfig = Field(default_factory=LifecycleConfig)
    load: LoadConfig = Field(default_factory=LoadConfig)
    routing: RoutingConfig = Field(default_factory=RoutingConfig)
    prefix: PrefixConfig = Field(default_factory=PrefixConfig)
    mode: Literal["decode-first", "ask-all"] = "decode-first"
    admin: AdminConfig = Field(default_factory=AdminConfig)
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    security: SecurityConfig = Field(default_factory=SecurityConfig)
    ask_all: AskAllConfig = Field(default_factory=AskAllConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    tracing: TracingConfig = Field(default_factory=TracingConfig)
    auth: AuthConfig = Field(default_factory=AuthConfig)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # The YAML document arrives as init values; the environment overrides it.
        return env_settings, init_settings

    @model_validator(mode="before")
    @classmethod
    def _accept_v1_lists(cls, data: Any) -> Any:
        return _legacy_pools(dict(data)) if isinstance(data, dict) else data

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        endpoints = self.fleet()
        names = [e.name for e in endpoints]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"endpoint names must be unique: {', '.join(duplicates)}")
        pools = [p.name for p in self.pools]
        if len(set(pools)) != len(pools):
            raise ValueError("pool names must be unique")
        decoders = [e for e in endpoints if e.decodes]
        if not decoders:
            raise ValueError("at least one decoder is needed (a pool with role decode or both)")
        if self.sidecar.enabled:
            if len(decoders) != 1:
                raise ValueError("sidecar mode serves exactly one local decoder")
            return self
        # a `both` endpoint with no other prefiller serves what it is sent on its own
        orphans = [d for d in decoders if not d.prefills and not self.compatible_prefillers(d)]
        if orphans:
            named = ", ".join(
                f"{o.name} (group {o.group}, connector {o.connector})" for o in orphans
            )
            raise ValueError(f"decoders without a compatible prefiller: {named}")
        return self

    def fleet(self) -> list[FleetEndpoint]:
        """Every endpoint of every pool, with pool defaults applied, in config order."""
        return [
            FleetEndpoint(
                name=e.name,
                url=e.url,
                role=pool.role,
                hardware=e.hardware or pool.hardware,
                model=e.model or pool.model,
                pool=pool.name,
                group=pool.compatibility_group,
                connector=pool.connector or self.connector,
                sim=e.sim or pool.sim,
                kv=e.kv or pool.kv or KvSettings(),
                api_key=pool.api_key or self.upstream.api_key,
                spill=pool.spill,
                profile=pool.profile,
            )
            for pool in self.pools
            for e in pool.endpoints
        ]

    def compatible_prefillers(self, decoder: FleetEndpoint) -> list[FleetEndpoint]:
        """Prefillers whose KV may reach ``decoder``: group rules (same group or
        host-staged) and connector rules (same connector or a declared bridge)."""
        groups = self.compatibility.group_pairs()
        connectors = self.compatibility.connector_pairs()
        return [
            p for p in self.fleet() if p.prefills and kv_may_move(p, decoder, groups, connectors)
        ]

    def endpoints(self) -> list[FleetEndpoint]:
        """Decode-capable endpoints first, then prefill-only ones."""
        fleet = self.fleet()
        return [e for e in fleet if e.decodes] + [e for e in fleet if not e.decodes]

    def models(self) -> list[str]:
        """The model names the decoders serve (configured ones), sorted."""
        return sorted({e.model for e in self.fleet() if e.decodes and e.model})

    def public_dict(self) -> dict[str, Any]:
        """The effective configuration as plain data."""
        return self.model_dump(mode="json")
