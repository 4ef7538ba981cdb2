"""Planning (pure): which decoders to ask, in which order, with which threshold."""

from pd_orchestrator.planner.plan import Plan, Planner, routing_request

__all__ = ["Plan", "Planner", "routing_request"]
