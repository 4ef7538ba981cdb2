"""Planning (pure): which decoders to ask, in which order, with which threshold."""

from pd_orchestrator.planner.plan import (
    DECODE_ONLY,
    NoCandidateError,
    Plan,
    Planner,
    RequestFacts,
    Served,
    compatibility_class,
)

__all__ = [
    "DECODE_ONLY",
    "NoCandidateError",
    "Plan",
    "Planner",
    "RequestFacts",
    "Served",
    "compatibility_class",
]
