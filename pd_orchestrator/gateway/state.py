"""What one configuration builds, and reloading it.

A :class:`GatewayState` holds everything built from one configuration: the fleet
(health and in-flight counts), the planner (routing profiles and threshold
policies), the prefix runtime, the monitors, the connectors and the attempt
strategy. A reload builds a new state and swaps it whole; requests in flight keep
the state they started with.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from connectors import Connector, get_connector
from pd_orchestrator.config.settings import GatewayConfig
from pd_orchestrator.fleet.allowlist import AllowListKeeper
from pd_orchestrator.fleet.cache_reports import CacheReports
from pd_orchestrator.fleet.endpoints import endpoints_from_config
from pd_orchestrator.fleet.health import HealthMonitor
from pd_orchestrator.fleet.scraper import LoadScraper
from pd_orchestrator.fleet.shared_sync import SharedState
from pd_orchestrator.fleet.state import FleetState
from pd_orchestrator.flows.attempts import Attempt, attempt_for
from pd_orchestrator.flows.flow import FlowSettings
from pd_orchestrator.gateway.prefix_runtime import PrefixRuntime
from pd_orchestrator.model.records import record
from pd_orchestrator.planner.plan import Planner
from pd_orchestrator.planner.width import AdaptiveWidth
from pd_orchestrator.policies import build_threshold
from pd_orchestrator.policies.goodput_model import knowledge_of
from pd_orchestrator.routing.profiles import build_profiles
from pd_orchestrator.telemetry.metrics import GatewayMetrics
from pd_orchestrator.upstream.client import Upstream

__all__ = [
    "GatewayState",
    "ReloadResult",
    "build_state",
    "check_plugins",
    "goodput_knowledge",
    "restart_notes",
]

logger = logging.getLogger(__name__)


@record
class ReloadResult:
    """Whether a reload took effect, and what to tell the operator."""

    applied: bool
    message: str


_AT_START: tuple[tuple[str, Callable[[GatewayConfig], object]], ...] = (
    ("listen", lambda c: c.listen),
    ("upstream connection pool", lambda c: (
        c.upstream.max_connections, c.upstream.max_keepalive_connections,
        c.upstream.keepalive_expiry, c.upstream.max_line_bytes,
    )),
    ("timeouts", lambda c: c.timeouts),
    ("tracing", lambda c: c.tracing),
    ("logging level and format", lambda c: (c.logging.level, c.logging.format)),
    ("lifecycle", lambda c: c.lifecycle),
)  # fmt: skip
"""The settings read once when the gateway starts (the HTTP server, the upstream
client, the tracer, the log handlers); everything else applies at a reload."""


def restart_notes(old: GatewayConfig, new: GatewayConfig) -> str:
    """Which changed settings only a restart applies (empty when none)."""
    changed = [name for name, read in _AT_START if read(old) != read(new)]
    return f"{', '.join(changed)} changes take effect at restart" if changed else ""


@dataclass(frozen=True)
class GatewayState:
    """Everything built from one configuration; swapped whole on reload."""

    config: GatewayConfig
    fleet: FleetState
    planner: Planner
    prefix: PrefixRuntime
    health: HealthMonitor
    scraper: LoadScraper
    allowlist: AllowListKeeper
    models: frozenset[str]
    attempt: Attempt
    flow: FlowSettings
    cache_reports: CacheReports = field(default_factory=CacheReports)
    """Which decoders report their cached counts (kept across reloads)."""
    shared: SharedState | None = None
    """The load shared with the other gateways (``shared_state.url``; None: off)."""
    timing: dict[str, str] = field(default_factory=dict)
    """Per pool timed at start-up, how its timing stands, in words
    (:mod:`~pd_orchestrator.gateway.calibrate`)."""


def goodput_knowledge(config: GatewayConfig) -> dict[str, str]:
    """Per pool, what a ``goodput`` policy of ``config`` starts from (empty: no
    ``goodput`` policy runs): see :func:`~pd_orchestrator.policies.goodput_model.knowledge_of`
    (several, comma-separated, when the pool's endpoints differ)."""
    if not _names_goodput(config.threshold.model_dump()):
        return {}
    known: dict[str, set[str]] = {}
    for endpoint in endpoints_from_config(config):
        known.setdefault(endpoint.pool, set()).add(knowledge_of(endpoint))
    return {pool: ", ".join(sorted(words)) for pool, words in sorted(known.items())}


def _source(words: str) -> str:
    """The ``source`` label of :func:`goodput_knowledge`'s words: ``measured``,
    ``simulator`` or ``seeds``, the least known of a pool whose endpoints differ."""
    kinds = {part.split(" ", 1)[0] for part in words.split(", ")}
    for kind in ("seeds", "simulator", "measured"):
        if kind in kinds:
            return kind
    return "seeds"


def _names_goodput(value: object) -> bool:
    """Whether a dumped threshold configuration names the ``goodput`` type anywhere
    (its default policy, an override, a composed part)."""
    if isinstance(value, dict):
        return value.get("type") == "goodput" or any(_names_goodput(v) for v in value.values())
    if isinstance(value, list):
        return any(_names_goodput(v) for v in value)
    return False


def check_plugins(config: GatewayConfig) -> None:
    """Build the routing profiles and the threshold policies of ``config`` once, so
    that an unknown plugin or a bad parameter is reported (``RoutingConfigError``)."""
    registry = PrefixRuntime(config.prefix, []).registry()
    build_profiles(config.routing, registry)
    build_threshold(config.threshold, registry, pools={pool.name for pool in config.pools})


def _connectors(config: GatewayConfig) -> dict[str, Connector]:
    names = {endpoint.connector for endpoint in config.fleet()} | {config.connector}
    return {name: get_connector(name) for name in sorted(names)}


def _adaptive_width(
    config: GatewayConfig, prefix: PrefixRuntime, previous: GatewayState | None
) -> AdaptiveWidth | None:
    """The adaptive width of an ask-all gateway with ``width: adaptive`` (with the
    precise index as evidence when configured), keeping what a previous one knew."""
    if config.mode != "ask-all" or config.ask_all.width != "adaptive":
        return None
    adaptive = AdaptiveWidth(config.ask_all.adaptive, prefix.index)
    if previous is not None and previous.planner.adaptive is not None:
        adaptive.inherit(previous.planner.adaptive)
    return adaptive


def build_state(
    config: GatewayConfig,
    upstream: Upstream,
    metrics: GatewayMetrics,
    clock: Callable[[], float],
    previous: GatewayState | None = None,
) -> GatewayState:
    """Build the state of ``config``; raises ``RoutingConfigError`` on bad plugins
    (policy errors are ``RoutingConfigError`` too).

    Endpoints that keep their name and URL across a reload keep their health; a
    ``goodput`` policy keeps what the one of the same name learnt; which decoders
    report their cached counts is kept.
    """
    endpoints = endpoints_from_config(config)
    fleet = FleetState(
        endpoints,
        config.health.unhealthy_after,
        outlier=config.outlier,
        clock=clock,
        on_eject=metrics.count_ejection,
        max_named=config.sidecar.max_named_targets,
    )
    metrics.label_upstreams({e.name for e in endpoints}, config.sidecar.max_named_targets)
    if previous is not None:
        fleet.inherit(previous.fleet)
    pairs = frozenset((p.prefill_group, p.decode_group) for p in config.compatibility.host_staged)
    prefix = PrefixRuntime(config.prefix, endpoints, fleet.pending)
    registry = prefix.registry()
    threshold = build_threshold(
        config.threshold, registry, pools={pool.name for pool in config.pools}
    )
    if previous is not None and previous.planner.threshold is not None:
        threshold.inherit(previous.planner.threshold)
    width = config.ask_all.width if config.mode == "ask-all" else None
    adaptive = _adaptive_width(config, prefix, previous)
    profiles = build_profiles(config.routing, registry)
    bridges = config.compatibility.connector_pairs()
    knowledge = goodput_knowledge(config)
    for pool, knows in knowledge.items():
        logger.info("goodput: pool %s starts from %s", pool, knows)
    metrics.set_knowledge({pool: _source(words) for pool, words in knowledge.items()})
    reports = CacheReports()
    if previous is not None:
        reports.inherit(previous.cache_reports)
    planner = Planner(profiles, threshold, pairs, width, bridges, adaptive, cache=prefix)
    shared = None
    if config.shared_state.url is not None:
        shared = SharedState(config.shared_state, fleet, threshold, clock, metrics.set_shared)
    return GatewayState(
        config=config,
        fleet=fleet,
        planner=planner,
        prefix=prefix,
        health=HealthMonitor(fleet, upstream, config.health),
        scraper=LoadScraper(fleet, upstream, config.load, clock=clock),
        allowlist=AllowListKeeper(
            config.sidecar.allowed_prefillers,
            config.sidecar.allowlist_file,
            config.sidecar.allowlist_refresh,
        ),
        models=frozenset(config.models()),
        attempt=attempt_for(
            config.mode, config.ask_all, metrics, config.limits.max_prompt_token_ids
        ),
        flow=FlowSettings(config.handback, config.upstream, _connectors(config), metrics, clock),
        cache_reports=reports,
        shared=shared,
    )
