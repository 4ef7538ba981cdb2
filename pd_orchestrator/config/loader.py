"""Loading and validating configuration files.

:func:`load_config` reads YAML, applies ``PDO_`` environment overrides and
validates; every problem becomes one :class:`ConfigError` whose message lists
each offending key with its dotted path (``decoders.0.urll: unknown key``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from pd_orchestrator.config.settings import GatewayConfig

__all__ = ["ConfigError", "load_config", "parse_config"]


class ConfigError(ValueError):
    """A configuration that cannot be used; the message says where and why."""


def _describe(exc: ValidationError) -> str:
    lines = []
    for error in exc.errors():
        where = ".".join(str(part) for part in error["loc"]) or "(top level)"
        message = "unknown key" if error["type"] == "extra_forbidden" else error["msg"]
        lines.append(f"  {where}: {message}")
    return "\n".join(lines)


def parse_config(data: Any, source: str = "config") -> GatewayConfig:
    """Validate already-decoded YAML ``data`` (environment overrides apply)."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the document must be a mapping")
    try:
        return GatewayConfig(**data)
    except ValidationError as exc:
        raise ConfigError(f"{source} is invalid:\n{_describe(exc)}") from None


def load_config(path: Path) -> GatewayConfig:
    """Read and validate the YAML file at ``path``."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {exc}") from None
    return parse_config(data, str(path))
