"""Endpoints: immutable descriptions of the vLLM instances the gateway talks to, and
a snapshot of one endpoint's state (ground floor: imports nothing of the project but
the connectors' address type)."""

from __future__ import annotations

import enum
from dataclasses import field
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from connectors import PeerInfo
from pd_orchestrator.model.records import record

if TYPE_CHECKING:
    from pd_orchestrator.model.measured import Knowledge

__all__ = ["Endpoint", "EndpointStatus", "Role"]


class Role(enum.StrEnum):
    """What an endpoint serves; ``BOTH`` serves decode and prefill requests."""

    DECODE = "decode"
    PREFILL = "prefill"
    BOTH = "both"

    decodes: bool
    """Serves decode requests (not ``PREFILL``)."""
    prefills: bool
    """Serves prefill requests (not ``DECODE``)."""

    def __init__(self, value: str) -> None:
        # plain attributes, set once per member: the planner reads them for every
        # endpoint of every request, where a property would be a call each time
        self.decodes = value != "prefill"
        self.prefills = value != "decode"


@record
class Endpoint:
    """A vLLM instance: config name, base URL, role, hardware label, model, pool,
    compatibility group (KV moves only between endpoints of one group), connector
    spec and ``kv``: its connector-relevant addresses (None: the defaults).
    ``authorization``: the ``Authorization`` value its legs carry instead of the
    client's (from the pool's ``api_key``), never printed. ``spill``: a prefiller that
    also serves whole requests (its pool's ``spill``): a threshold policy may send a
    decode-first request there, at threshold 0, when its decoder is crowded or queued.
    ``knowledge``: the latency profile known for it (its pool's ``profile``, or the
    one the simulator it was started as runs), None when nothing is known."""

    name: str
    url: str
    role: Role
    hardware: str = "unknown"
    model: str | None = None
    pool: str = "default"
    group: str = "default"
    connector: str = "nixl"
    kv: PeerInfo | None = None
    authorization: str | None = field(default=None, repr=False, compare=False)
    spill: bool = False
    knowledge: Knowledge | None = field(default=None, compare=False)

    @property
    def peer(self) -> PeerInfo:
        """The addresses the connectors need: ``kv``, else the URL's host and vLLM's
        default side-channel ports."""
        if self.kv is not None:
            return self.kv
        return PeerInfo(host=urlsplit(self.url).hostname or "127.0.0.1")

    @property
    def host_port(self) -> str:
        """``host:port`` of the URL (the form llm-d's prefiller header uses)."""
        parts = urlsplit(self.url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
        return f"{parts.hostname}:{port}"


@record
class EndpointStatus:
    """A snapshot of one endpoint; ``backlog``: prompt tokens of the gateway's requests
    in flight there that have not had their first answer yet (their prefill is queued
    or under way)."""

    endpoint: Endpoint
    healthy: bool
    in_flight: int
    backlog: int = 0
