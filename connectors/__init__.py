"""KV-connector protocol adapters for P/D disaggregation (pure: no I/O).

A connector knows how vLLM's KV connector of the same name expects a proxy to
drive a prefill/decode pair: the prefill body, where the transfer parameters come
back, the decode body, and whether the two legs run one after the other or
together. This package never imports ``pd_orchestrator``.
"""

from connectors._base import (
    Connector,
    LegOrder,
    PrefillOutcome,
    UnknownConnectorError,
)
from connectors._registry import available, get_connector

__all__ = [
    "Connector",
    "LegOrder",
    "PrefillOutcome",
    "UnknownConnectorError",
    "available",
    "get_connector",
]
