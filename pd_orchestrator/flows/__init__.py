"""Flows: the only code that sequences upstream legs for a client request."""

from pd_orchestrator.flows.attempts import Attempt, Attempted, Probe, Race, Single, attempt_for
from pd_orchestrator.flows.flow import Flow, FlowSettings, Outcome
from pd_orchestrator.flows.legs import Leg, Legs
from pd_orchestrator.flows.render import Renderer, StreamRenderer, WholeRenderer, renderer_for
from pd_orchestrator.flows.request import ClientRequest
from pd_orchestrator.flows.sink import ClientSink, GatewayError

__all__ = [
    "Attempt",
    "Attempted",
    "ClientRequest",
    "ClientSink",
    "Flow",
    "FlowSettings",
    "GatewayError",
    "Leg",
    "Legs",
    "Outcome",
    "Probe",
    "Race",
    "Renderer",
    "Single",
    "StreamRenderer",
    "WholeRenderer",
    "attempt_for",
    "renderer_for",
]
