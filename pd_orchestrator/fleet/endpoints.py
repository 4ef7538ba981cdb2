"""Endpoints: immutable descriptions of the vLLM instances the gateway talks to."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from connectors import PeerInfo
from pd_orchestrator.config.settings import FleetEndpoint, GatewayConfig

__all__ = ["Endpoint", "Role", "endpoints_from_config"]


class Role(enum.StrEnum):
    """What an endpoint serves; ``BOTH`` serves decode and prefill requests."""

    DECODE = "decode"
    PREFILL = "prefill"
    BOTH = "both"

    @property
    def decodes(self) -> bool:
        return self is not Role.PREFILL

    @property
    def prefills(self) -> bool:
        return self is not Role.DECODE


@dataclass(frozen=True, slots=True)
class Endpoint:
    """A vLLM instance: config name, base URL, role, hardware label, model, pool,
    compatibility group (KV moves only between endpoints of one group), connector
    spec and ``kv``: its connector-relevant addresses (None: the defaults).
    ``authorization``: the ``Authorization`` value its legs carry instead of the
    client's (from the pool's ``api_key``), never printed."""

    name: str
    url: str
    role: Role
    hardware: str = "unknown"
    model: str | None = None
    pool: str = "default"
    group: str = "default"
    connector: str = "nixl"
    kv: PeerInfo | None = None
    authorization: str | None = field(default=None, repr=False, compare=False)

    @property
    def peer(self) -> PeerInfo:
        """The addresses the connectors need: ``kv``, else the URL's host and vLLM's
        default side-channel ports."""
        if self.kv is not None:
            return self.kv
        return PeerInfo(host=urlsplit(self.url).hostname or "127.0.0.1")

    @property
    def host_port(self) -> str:
        """``host:port`` of the URL (the form llm-d's prefiller header uses)."""
        parts = urlsplit(self.url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
        return f"{parts.hostname}:{port}"


def _endpoint(config: FleetEndpoint) -> Endpoint:
    if config.url is None:
        raise ValueError(f"endpoint {config.name!r} has no url (start it with `up`)")
    return Endpoint(
        name=config.name,
        url=config.url,
        role=Role(config.role),
        hardware=config.hardware,
        model=config.model,
        pool=config.pool,
        group=config.group,
        connector=config.connector,
        kv=config.peer,
        authorization=None
        if config.api_key is None
        else f"Bearer {config.api_key.get_secret_value()}",
    )


def endpoints_from_config(config: GatewayConfig) -> list[Endpoint]:
    """Every configured endpoint, decode-capable ones first."""
    return [_endpoint(e) for e in config.endpoints()]
