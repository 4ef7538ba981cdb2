"""KV-connector protocol adapters for P/D disaggregation (pure: no I/O).

A connector knows how vLLM's KV connector of the same name expects a proxy to
drive a prefill/decode pair: the prefill body, where the transfer parameters come
back, the decode body, the headers both legs need, any lookup the executor must
do first, and whether the two legs run one after the other or together. Each
module's docstring is the contract the flow executor follows for that connector;
``connectors._base`` explains the leg orders. This package never imports
``pd_orchestrator``.
"""

from connectors._base import (
    MOONCAKE_BOOTSTRAP_PORT,
    MORIIO_HANDSHAKE_PORT,
    MORIIO_NOTIFY_PORT,
    NIXL_SIDE_CHANNEL_PORT,
    P2P_SIDE_CHANNEL_PORT,
    Connector,
    ConnectorError,
    ConnectorInfo,
    Leg,
    LegOrder,
    Lookup,
    MissingContextError,
    PeerInfo,
    PeerUpdate,
    PrefillOutcome,
    TransferContext,
    UnknownConnectorError,
    named_hosts,
)
from connectors._registry import available, can_pair, get_connector, parse_spec

__all__ = [
    "MOONCAKE_BOOTSTRAP_PORT",
    "MORIIO_HANDSHAKE_PORT",
    "MORIIO_NOTIFY_PORT",
    "NIXL_SIDE_CHANNEL_PORT",
    "P2P_SIDE_CHANNEL_PORT",
    "Connector",
    "ConnectorError",
    "ConnectorInfo",
    "Leg",
    "LegOrder",
    "Lookup",
    "MissingContextError",
    "PeerInfo",
    "PeerUpdate",
    "PrefillOutcome",
    "TransferContext",
    "UnknownConnectorError",
    "available",
    "can_pair",
    "get_connector",
    "named_hosts",
    "parse_spec",
]
