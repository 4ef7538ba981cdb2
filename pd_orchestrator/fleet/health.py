"""Active health checks: ``GET /health`` on every endpoint at a fixed interval.

A check that fails (no answer within the timeout, or a non-200) counts as one
failure -- one without an answer in time does not when the endpoint answered real
traffic since its previous check (a busy server answers health checks late);
``unhealthy_after`` failures in a row mark the endpoint unhealthy, one success
marks it healthy again (and brings back an endpoint whose ejection time is up).
Flows add what real traffic shows (:meth:`FleetState.record_error`).
"""

from __future__ import annotations

import anyio
from anyio.abc import TaskStatus

from pd_orchestrator.config.settings import HealthConfig
from pd_orchestrator.fleet.state import FleetState
from pd_orchestrator.model.endpoints import Endpoint
from pd_orchestrator.upstream.client import Upstream
from pd_orchestrator.upstream.errors import UpstreamError, UpstreamTimeout

__all__ = ["HealthMonitor"]


class HealthMonitor:
    """Polls every endpoint of ``fleet`` until cancelled."""

    def __init__(self, fleet: FleetState, upstream: Upstream, config: HealthConfig) -> None:
        self.fleet = fleet
        self.upstream = upstream
        self.config = config

    async def check(self, endpoint: Endpoint) -> bool:
        """One check of one endpoint; records and returns the result. A check the
        gateway could not make (out of its own descriptors) is not recorded."""
        late = False
        try:
            response = await self.upstream.get(endpoint, "/health", limit=self.config.timeout)
            healthy = response.status_code == 200
        except UpstreamTimeout:
            healthy, late = False, True
        except UpstreamError as exc:
            if exc.gateways_own:
                return False
            healthy = False
        self.fleet.record_check(endpoint.name, healthy, late=late)
        return healthy

    async def check_all(self) -> None:
        async with anyio.create_task_group() as tg:
            for endpoint in self.fleet.endpoints():
                tg.start_soon(self.check, endpoint)
        self.fleet.checked_once = True

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Check now, report started, then check every ``interval`` seconds."""
        await self.check_all()
        task_status.started()
        while True:
            await anyio.sleep(self.config.interval)
            await self.check_all()
