"""Gateway configuration: typed settings from a YAML file and ``PDO_`` environment."""

from pd_orchestrator.config.loader import ConfigError, load_config, parse_config
from pd_orchestrator.config.settings import (
    EndpointConfig,
    GatewayConfig,
    HandbackConfig,
    SidecarConfig,
    SimSpec,
    ThresholdConfig,
    TimeoutConfig,
    UpstreamConfig,
)

__all__ = [
    "ConfigError",
    "EndpointConfig",
    "GatewayConfig",
    "HandbackConfig",
    "SidecarConfig",
    "SimSpec",
    "ThresholdConfig",
    "TimeoutConfig",
    "UpstreamConfig",
    "load_config",
    "parse_config",
]
