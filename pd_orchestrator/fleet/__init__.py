"""The fleet: endpoints, their roles, health and in-flight load."""

from pd_orchestrator.fleet.endpoints import endpoints_from_config
from pd_orchestrator.fleet.state import FleetState
from pd_orchestrator.model.endpoints import Endpoint, EndpointStatus, Role

__all__ = ["Endpoint", "EndpointStatus", "FleetState", "Role", "endpoints_from_config"]
