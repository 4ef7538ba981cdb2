"""The configured endpoints (:class:`~pd_orchestrator.model.endpoints.Endpoint`) of a
gateway configuration."""

from __future__ import annotations

from pd_orchestrator.config.settings import FleetEndpoint, GatewayConfig
from pd_orchestrator.model.endpoints import Endpoint, Role
from pd_orchestrator.model.measured import Knowledge, knowledge_for

__all__ = ["endpoints_from_config", "knowledge_of"]


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
        knowledge=knowledge_of(config),
    )


def knowledge_of(config: FleetEndpoint) -> Knowledge | None:
    """The latency profile known for an endpoint: its pool's ``profile``, else the
    profile of the ``sim`` block it was started from (``up``: a simulator whose
    constants are exact), else None (a real engine nobody measured: a bare
    ``hardware`` label picks no simulator constants)."""
    if config.profile is not None:
        return knowledge_for(config.profile)
    if config.sim is not None:
        return knowledge_for(config.sim.profile)
    return None


def endpoints_from_config(config: GatewayConfig) -> list[Endpoint]:
    """Every configured endpoint, decode-capable ones first."""
    return [_endpoint(e) for e in config.endpoints()]
