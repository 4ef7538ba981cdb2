"""The gateway's Prometheus metrics."""

from pd_orchestrator.telemetry.metrics import GatewayMetrics

__all__ = ["GatewayMetrics"]
