"""The configured endpoints (:class:`~pd_orchestrator.model.endpoints.Endpoint`) of a
gateway configuration."""

from __future__ import annotations

from pd_orchestrator.config.settings import FleetEndpoint, GatewayConfig
from pd_orchestrator.model.endpoints import Endpoint, Role

__all__ = ["endpoints_from_config"]


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
        spill=config.spill,
    )


def endpoints_from_config(config: GatewayConfig) -> list[Endpoint]:
    """Every configured endpoint, decode-capable ones first."""
    return [_endpoint(e) for e in config.endpoints()]
