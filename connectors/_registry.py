"""Connector adapters by name, and which connectors can pair.

A connector is named by a *spec*: a registered name (``nixl``, ``nixl-push``,
``mooncake``, ``lmcache``, ``offloading``, ``moriio``, ``example``) or
``multi:A,B,...`` for vLLM's ``MultiConnector`` over registered names, in order.
"""

from __future__ import annotations

from collections.abc import Callable

from connectors._base import (
    Adapter,
    Connector,
    ConnectorError,
    ConnectorInfo,
    UnknownConnectorError,
)
from connectors.example import ExampleConnector
from connectors.lmcache import LMCacheConnector
from connectors.mooncake import MooncakeConnector
from connectors.moriio import MoRIIOConnector
from connectors.multi import MultiConnector
from connectors.nixl import NixlConnector
from connectors.nixl_push import NixlPushConnector
from connectors.offloading import OffloadingConnector

__all__ = ["available", "can_pair", "get_connector", "parse_spec"]

MULTI_PREFIX = "multi:"

_FACTORIES: dict[str, Callable[[], Adapter]] = {
    "example": ExampleConnector,
    "lmcache": LMCacheConnector,
    "mooncake": MooncakeConnector,
    "moriio": MoRIIOConnector,
    "nixl": NixlConnector,
    "nixl-push": NixlPushConnector,
    "offloading": OffloadingConnector,
}


def available() -> list[str]:
    """Names of the registered adapters, sorted (``multi:`` composes them)."""
    return sorted(_FACTORIES)


def _single(name: str) -> Adapter:
    try:
        factory = _FACTORIES[name]
    except KeyError:
        raise UnknownConnectorError(
            f"unknown connector {name!r} (known: {', '.join(available())}, multi:A,B)"
        ) from None
    return factory()


def parse_spec(spec: str) -> tuple[str, ...]:
    """The registered names a spec stands for (one, or a multi's children in order).

    Raises :class:`UnknownConnectorError` for an unknown name and
    :class:`ConnectorError` for a malformed ``multi:`` list.
    """
    if not spec.startswith(MULTI_PREFIX):
        _single(spec)
        return (spec,)
    names = tuple(part.strip() for part in spec[len(MULTI_PREFIX) :].split(","))
    if not names or any(not n for n in names):
        raise ConnectorError(f"{spec!r}: multi needs a comma-separated list of connectors")
    for name in names:
        _single(name)
    return names


def get_connector(spec: str) -> Connector:
    """A new adapter for ``spec`` (see the module docstring)."""
    names = parse_spec(spec)
    if not spec.startswith(MULTI_PREFIX):
        return _single(spec)
    return MultiConnector([_single(n) for n in names])


def _info(connector: Connector | ConnectorInfo | str) -> ConnectorInfo:
    if isinstance(connector, ConnectorInfo):
        return connector
    if isinstance(connector, str):
        connector = get_connector(connector)
    return connector.describe()


def can_pair(
    prefill: Connector | ConnectorInfo | str, decode: Connector | ConnectorInfo | str
) -> bool:
    """Whether a prefiller speaking ``prefill`` can hand KV to a decoder speaking ``decode``.

    Same connector: yes. Different ones (a bridge the configuration must declare):
    only through a KV path both have (``multi:nixl,offloading`` pairs with ``nixl``).
    The decoder's adapter then shapes both legs.
    """
    p, d = _info(prefill), _info(decode)
    return p.name == d.name or bool(p.handovers & d.handovers)
