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


def _legacy_names(data: dict[str, Any]) -> dict[int, str]:
    """Pool index -> the v1 list it was made from (``decoders`` / ``prefillers``)."""
    index = len(data.get("pools") or [])
    names: dict[int, str] = {}
    for key in ("decoders", "prefillers"):
        if data.get(key):
            names[index] = key
            index += 1
    return names


def _location(loc: tuple[int | str, ...], legacy: dict[int, str]) -> str:
    parts = [str(part) for part in loc]
    if len(parts) >= 3 and parts[0] == "pools" and parts[2] == "endpoints":
        name = legacy.get(int(parts[1]))
        if name is not None:
            parts = [name, *parts[3:]]
    return ".".join(parts) or "(top level)"


def _describe(exc: ValidationError, data: dict[str, Any]) -> str:
    legacy = _legacy_names(data)
    lines = []
    for error in exc.errors():
        where = _location(error["loc"], legacy)
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
        raise ConfigError(f"{source} is invalid:\n{_describe(exc, data)}") from None


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
