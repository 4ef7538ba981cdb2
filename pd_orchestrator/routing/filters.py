"""Built-in filters: ``healthy``, ``model``, ``role`` and ``compatibility``.

Each keeps a subset of the candidates in their input order and never reorders.
"""

from __future__ import annotations

from collections.abc import Sequence

from pd_orchestrator.model.compatibility import kv_may_move
from pd_orchestrator.model.endpoints import Role
from pd_orchestrator.model.load import Candidate
from pd_orchestrator.model.records import record
from pd_orchestrator.routing.interfaces import PluginContext
from pd_orchestrator.routing.plugin_params import CompatibilityParams, GroupPair, HealthyParams
from pd_orchestrator.routing.registry import FILTER, NoParams, PluginType
from pd_orchestrator.routing.types import RoutingRequest

__all__ = [
    "COMPATIBILITY",
    "HEALTHY",
    "MODEL",
    "ROLE",
    "CompatibilityFilter",
    "CompatibilityParams",
    "GroupPair",
    "HealthyFilter",
    "HealthyParams",
    "ModelFilter",
    "RoleFilter",
]


@record
class HealthyFilter:
    """``healthy``: keeps candidates marked healthy (health checks and load polls),
    or all of them when none is (``panic``).

    By default health is all that counts; see :class:`HealthyParams` to also
    require a fresh load reading. The planner offers each profile only the
    endpoints of its role, so "none is healthy" means none of that role.
    """

    params: HealthyParams

    @property
    def trusted(self) -> bool:
        """Keeps a subsequence of what it is offered: the engine need not check."""
        return True

    def filter(
        self, request: RoutingRequest, candidates: Sequence[Candidate]
    ) -> Sequence[Candidate]:
        if self.params.require_load:
            kept = [c for c in candidates if c.healthy and self._load_ok(c, request.now)]
        else:
            kept = [c for c in candidates if c.healthy]
        return kept if kept or not self.params.panic else list(candidates)

    def _load_ok(self, candidate: Candidate, now: float) -> bool:
        if candidate.load is None:
            return False
        max_age = self.params.max_load_age
        return max_age is None or candidate.load.age(now) <= max_age


@record
class ModelFilter:
    """``model``: keeps endpoints that serve ``request.model``.

    An endpoint without a configured model serves anything; a request without a
    model keeps every candidate. No parameters.
    """

    @property
    def trusted(self) -> bool:
        """Keeps a subsequence of what it is offered: the engine need not check."""
        return True

    def filter(
        self, request: RoutingRequest, candidates: Sequence[Candidate]
    ) -> Sequence[Candidate]:
        wanted = request.model
        if wanted is None:
            return list(candidates)
        return [c for c in candidates if c.endpoint.model in (None, wanted)]


@record
class RoleFilter:
    """``role``: keeps endpoints whose role is ``request.role`` or ``both``.

    A request for role ``both`` keeps every candidate. No parameters.
    """

    @property
    def trusted(self) -> bool:
        """Keeps a subsequence of what it is offered: the engine need not check."""
        return True

    def filter(
        self, request: RoutingRequest, candidates: Sequence[Candidate]
    ) -> Sequence[Candidate]:
        role = request.role
        if role is Role.BOTH:
            return list(candidates)
        roles = (role, Role.BOTH)
        return [c for c in candidates if c.endpoint.role in roles]


@record
class CompatibilityFilter:
    """``compatibility``: for prefill routing, keeps prefillers whose KV can reach
    ``request.decoder``.

    A candidate is kept when it is another endpoint than the decoder, speaks the
    decoder's KV connector (or the pair ``(candidate connector, decoder connector)``
    is in ``request.allowed_connector_pairs``: a configured bridge), and its group
    is the decoder's group or the directed pair ``(candidate group, decoder
    group)`` is in ``pairs`` or in ``request.allowed_pairs``. Without a decoder on
    the request there is nothing to be compatible with and every candidate is kept.
    """

    pairs: frozenset[tuple[str, str]]

    @property
    def trusted(self) -> bool:
        """Keeps a subsequence of what it is offered: the engine need not check."""
        return True

    def filter(
        self, request: RoutingRequest, candidates: Sequence[Candidate]
    ) -> Sequence[Candidate]:
        decoder = request.decoder
        if decoder is None:
            return list(candidates)
        allowed = self.pairs | request.allowed_pairs
        bridges = request.allowed_connector_pairs
        return [c for c in candidates if kv_may_move(c.endpoint, decoder, allowed, bridges)]


def _healthy(params: HealthyParams, context: PluginContext) -> HealthyFilter:
    return HealthyFilter(params)


def _model(params: NoParams, context: PluginContext) -> ModelFilter:
    return ModelFilter()


def _role(params: NoParams, context: PluginContext) -> RoleFilter:
    return RoleFilter()


def _compatibility(params: CompatibilityParams, context: PluginContext) -> CompatibilityFilter:
    return CompatibilityFilter(frozenset((p.prefill, p.decode) for p in params.pairs))


HEALTHY = PluginType("healthy", FILTER, HealthyParams, _healthy)
MODEL = PluginType("model", FILTER, NoParams, _model)
ROLE = PluginType("role", FILTER, NoParams, _role)
COMPATIBILITY = PluginType("compatibility", FILTER, CompatibilityParams, _compatibility)
