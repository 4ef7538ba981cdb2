"""Endpoints: immutable descriptions of the vLLM instances the gateway talks to."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from urllib.parse import urlsplit

from pd_orchestrator.config.settings import EndpointConfig, GatewayConfig

__all__ = ["Endpoint", "Role", "endpoints_from_config"]


class Role(enum.StrEnum):
    """What an endpoint serves; ``BOTH`` serves decode and prefill requests."""

    DECODE = "decode"
    PREFILL = "prefill"
    BOTH = "both"


@dataclass(frozen=True, slots=True)
class Endpoint:
    """A vLLM instance: config name, base URL, role, hardware label, model, pool and
    compatibility group (KV moves only between endpoints of one group)."""

    name: str
    url: str
    role: Role
    hardware: str = "unknown"
    model: str | None = None
    pool: str = "default"
    group: str = "default"

    @property
    def host_port(self) -> str:
        """``host:port`` of the URL (the form llm-d's prefiller header uses)."""
        parts = urlsplit(self.url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
        return f"{parts.hostname}:{port}"


def _endpoint(config: EndpointConfig, role: Role) -> Endpoint:
    if config.url is None:
        raise ValueError(f"endpoint {config.name!r} has no url (start it with `up`)")
    return Endpoint(config.name, config.url, role, config.hardware, config.model)


def endpoints_from_config(config: GatewayConfig) -> list[Endpoint]:
    """Every configured endpoint, decoders first."""
    return [_endpoint(c, Role.DECODE) for c in config.decoders] + [
        _endpoint(c, Role.PREFILL) for c in config.prefillers
    ]
