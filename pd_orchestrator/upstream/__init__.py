"""All HTTP traffic to vLLM instances, and the mapping of its failures to answers."""

from pd_orchestrator.upstream.client import ChunkStream, Phase, Upstream
from pd_orchestrator.upstream.errors import (
    ClientError,
    UpstreamError,
    UpstreamProtocolError,
    UpstreamStatusError,
    UpstreamTimeout,
    UpstreamUnavailable,
    client_error,
)

__all__ = [
    "ChunkStream",
    "ClientError",
    "Phase",
    "Upstream",
    "UpstreamError",
    "UpstreamProtocolError",
    "UpstreamStatusError",
    "UpstreamTimeout",
    "UpstreamUnavailable",
    "client_error",
]
