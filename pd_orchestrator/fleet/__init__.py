"""The fleet: endpoints, their roles, health and in-flight load."""

from pd_orchestrator.fleet.endpoints import Endpoint, Role, endpoints_from_config
from pd_orchestrator.fleet.state import EndpointStatus, FleetState

__all__ = ["Endpoint", "EndpointStatus", "FleetState", "Role", "endpoints_from_config"]
