"""Several gateways, one fleet: the load they share through a NATS server.

:class:`SharedState` runs beside the health checks and load polls when
``shared_state.url`` names a NATS server. Every ``interval`` it publishes this
gateway's :class:`~pd_orchestrator.model.shared_load.LoadReport` on ``subject`` and
hands what the other gateways last published (summed,
:class:`~pd_orchestrator.model.shared_load.PeerReports`) to the fleet state (requests
in flight and queued prompt tokens per endpoint) and to the ``goodput`` policies
(prefill tokens kept per decoder). Requests read those sums from memory and never
wait on the server.

While the server is unreachable (not yet connected, or the connection lost) the
others' sums are dropped, so each gateway counts its own state alone, as a single
gateway does; ``/status`` (:meth:`SharedState.status`) and the
``pd_orchestrator_shared_state_connected`` gauge say so, and the connection is
retried with a bounded backoff. NATS is what Dynamo's routers use to share their
replicas' state.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from typing import Any

import anyio
import nats
from anyio.abc import TaskStatus
from nats.aio.client import Client
from nats.aio.msg import Msg

from pd_orchestrator.config.settings import SharedStateConfig
from pd_orchestrator.fleet.state import FleetState
from pd_orchestrator.model.shared_load import LoadReport, PeerReports, Totals, decode, encode
from pd_orchestrator.policies.threshold import ThresholdResolver

__all__ = ["SharedState"]

logger = logging.getLogger("pd_orchestrator.fleet.shared")

_RETRY_FIRST = 0.5
_RETRY_MAX = 5.0
"""Seconds between two attempts to reach the server: doubling from the first to the
most."""


class SharedState:
    """Publishes this gateway's load and applies the others' (module docstring).

    ``fleet`` and ``threshold``: the state the sums are handed to; ``clock``: the
    gateway's (the duty cycles' time base); ``on_change``: told ``(connected,
    peers)`` after each interval (metrics)."""

    def __init__(
        self,
        config: SharedStateConfig,
        fleet: FleetState,
        threshold: ThresholdResolver | None,
        clock: Callable[[], float],
        on_change: Callable[[bool, int], None] | None = None,
    ) -> None:
        self.config = config
        self.fleet = fleet
        self.threshold = threshold
        self.clock = clock
        self.on_change = on_change
        self.gateway = uuid.uuid4().hex
        self.peers = PeerReports(self.gateway, config.ttl)
        self.connected = False
        self.last_error: str | None = None
        self._peer_count = 0

    def status(self) -> dict[str, Any]:
        """What ``/status`` shows: the server, whether it is reachable, how many other
        gateways count, and the last error (None: none since the last connection)."""
        return {
            "url": self.config.url,
            "subject": self.config.subject,
            "connected": self.connected,
            "peers": self._peer_count,
            "counting": "shared" if self.connected else "own state only",
            "last_error": self.last_error,
        }

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Report started at once (a request never waits for the server), then connect
        and share until cancelled, reconnecting with backoff."""
        task_status.started()
        delay = _RETRY_FIRST
        while True:
            try:
                client = await nats.connect(
                    self.config.url or "",
                    name=f"pd-orchestrator-{self.gateway[:8]}",
                    connect_timeout=1,
                    allow_reconnect=False,
                    max_reconnect_attempts=0,
                    error_cb=self._on_error,
                )
            except Exception as exc:  # any failure to connect: retry
                self._down(f"cannot connect to {self.config.url}: {exc or type(exc).__name__}")
                await anyio.sleep(delay)
                delay = min(delay * 2, _RETRY_MAX)
                continue
            delay = _RETRY_FIRST
            try:
                await self._share(client)
            except Exception as exc:  # a lost connection: reconnect
                self._down(f"connection to {self.config.url} lost: {exc or type(exc).__name__}")
            finally:
                with anyio.move_on_after(1, shield=True):
                    await client.close()

    async def _share(self, client: Client) -> None:
        """Subscribe, then publish and apply every ``interval`` while connected."""
        await client.subscribe(self.config.subject, cb=self._on_message)
        await client.flush(timeout=1)
        if not self.connected:
            logger.info("shared state: connected to %s", self.config.url)
        self.connected, self.last_error = True, None
        while client.is_connected:
            await client.publish(self.config.subject, encode(self._report()))
            self._apply(self.peers.totals(self.clock()))
            await anyio.sleep(self.config.interval)
        raise ConnectionError("the server closed the connection")

    def _report(self) -> LoadReport:
        now = self.clock()
        kept = self.threshold.kept(now) if self.threshold is not None else {}
        return LoadReport(self.gateway, self.fleet.own_load(), kept)

    def _apply(self, totals: Totals) -> None:
        """Hand the others' sums to the fleet and the policies (none: each alone)."""
        self.fleet.share(totals.endpoints)
        if self.threshold is not None:
            self.threshold.share_kept(totals.kept, self.clock())
        self._peer_count = totals.peers
        if self.on_change is not None:
            self.on_change(self.connected, totals.peers)

    def _down(self, why: str) -> None:
        """The server is unreachable: count this gateway's own state alone."""
        if self.connected or self.last_error is None:
            logger.warning("shared state: %s; counting this gateway's own state only", why)
        self.connected, self.last_error = False, why
        self.peers.clear()
        self._apply(Totals())

    async def _on_message(self, message: Msg) -> None:
        report = decode(message.data)
        if report is not None:
            self.peers.receive(report, self.clock())

    async def _on_error(self, exc: Exception) -> None:
        self.last_error = str(exc) or type(exc).__name__
