"""Connector adapters by name."""

from __future__ import annotations

from collections.abc import Callable

from connectors._base import Connector, UnknownConnectorError
from connectors.example import ExampleConnector
from connectors.nixl import NixlConnector

__all__ = ["available", "get_connector"]

_FACTORIES: dict[str, Callable[[], Connector]] = {
    "nixl": NixlConnector,
    "example": ExampleConnector,
}


def available() -> list[str]:
    """Names of the registered adapters, sorted."""
    return sorted(_FACTORIES)


def get_connector(name: str) -> Connector:
    """A new adapter for ``name``; :class:`UnknownConnectorError` lists the known names."""
    try:
        factory = _FACTORIES[name]
    except KeyError:
        raise UnknownConnectorError(
            f"unknown connector {name!r} (known: {', '.join(available())})"
        ) from None
    return factory()
