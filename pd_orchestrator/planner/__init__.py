"""Planning (pure): which decoder to ask first and which prefillers may serve it."""

from pd_orchestrator.planner.decode_first import Plan, order_candidates, plan_decode_first

__all__ = ["Plan", "order_candidates", "plan_decode_first"]
