"""Flows: the only code that sequences upstream legs for a client request."""

from pd_orchestrator.flows.decode_first import DecodeFirstFlow, FlowContext
from pd_orchestrator.flows.request import ClientRequest
from pd_orchestrator.flows.sink import ClientSink, GatewayError

__all__ = ["ClientRequest", "ClientSink", "DecodeFirstFlow", "FlowContext", "GatewayError"]
