"""Which prefillers may hand KV to which decoder: the rule, written once (ground floor).

KV moves from a prefiller to a decoder when they are two instances, their connectors
are the same or a declared bridge, and their compatibility groups are the same or a
declared pair (a host-staged pair, or one a request adds). The configuration checks
it for the planner's tables; the routing filter applies it per request.
"""

from __future__ import annotations

from collections.abc import Container
from typing import Protocol

__all__ = ["KvSide", "kv_may_move"]


class KvSide(Protocol):
    """What the rule reads of an instance (an endpoint or its configuration)."""

    @property
    def name(self) -> str: ...

    @property
    def group(self) -> str: ...

    @property
    def connector(self) -> str: ...


def kv_may_move(
    prefiller: KvSide,
    decoder: KvSide,
    group_pairs: Container[tuple[str, str]] = (),
    connector_pairs: Container[tuple[str, str]] = (),
) -> bool:
    """Whether ``prefiller``'s KV may reach ``decoder``: two instances, the same
    connector or a ``(prefill, decode)`` pair of ``connector_pairs``, the same group or a
    ``(prefill, decode)`` pair of ``group_pairs``."""
    return (
        prefiller.name != decoder.name
        and (
            prefiller.connector == decoder.connector
            or (prefiller.connector, decoder.connector) in connector_pairs
        )
        and (prefiller.group == decoder.group or (prefiller.group, decoder.group) in group_pairs)
    )
