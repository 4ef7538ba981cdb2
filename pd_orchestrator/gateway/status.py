"""What the gateway reports about itself: ``/status``, ``/ready`` and ``/v1/models``.

Pure functions of a :class:`~pd_orchestrator.gateway.state.GatewayState` and the
clock; endpoints appear by their configured names, never their URLs.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from pd_orchestrator.gateway.state import GatewayState, goodput_knowledge
from pd_orchestrator.model.endpoints import Role

__all__ = ["models_document", "ready_document", "status_document"]


def _ejection(state: GatewayState, name: str, now: float) -> dict[str, Any] | None:
    """An ejected endpoint's reason, seconds left and times ejected (None: in routing)."""
    outlier = state.fleet.outlier_of(name)
    if outlier is None or outlier.ejected_until is None:
        return None
    return {
        "reason": outlier.reason,
        "seconds_left": round(max(0.0, outlier.ejected_until - now), 3),
        "times": outlier.ejections,
    }


def status_document(state: GatewayState, now: float) -> dict[str, Any]:
    """``GET /status``: the fleet by endpoint name with health (``healthy``: in routing;
    ``ejected``: taken out by outlier detection), in-flight and load (with
    ``admission_only``: its threshold plugin takes ``cache_hit_admission_only``;
    ``resumes``: it takes ``cache_hit_resume_tokens``) and ``cached_counts``: whether it
    reports ``prompt_tokens_details`` (``reporting``, ``unknown`` or ``silent``: see
    :mod:`~pd_orchestrator.fleet.cache_reports`); with a ``goodput`` policy,
    ``goodput_starts_from``: per pool, a measured profile, a simulator's or seeds, and
    ``goodput_learnt``: per policy and pool, the rates, ITL and hand-over costs its
    model holds now, and ``goodput_timing``: per pool timed at start-up
    (:mod:`~pd_orchestrator.gateway.calibrate`), ``timing on E``, ``timed on E: N
    prompts`` or ``failed on E after N prompts``; with ``shared_state.url``,
    ``shared_state``: the NATS server, whether it is reachable (else this gateway
    counts its own state only) and how many other gateways count. ``in_flight`` and
    ``backlog`` include the other gateways' while shared."""
    endpoints = []
    for status in state.fleet.snapshot():
        endpoint = status.endpoint
        load = state.scraper.snapshot(endpoint.name, now)
        endpoints.append(
            {
                "name": endpoint.name,
                "pool": endpoint.pool,
                "role": endpoint.role.value,
                "hardware": endpoint.hardware,
                "group": endpoint.group,
                "healthy": status.healthy and state.scraper.is_responsive(endpoint.name),
                "ejected": _ejection(state, endpoint.name, now),
                "in_flight": status.in_flight,
                "backlog": status.backlog,
                "cached_counts": state.cache_reports.state(endpoint.name),
                "load": None
                if load is None
                else {
                    "running": load.running,
                    "waiting": load.waiting,
                    "kv_usage": load.kv_usage,
                    "prefix_hit_rate": load.prefix_hit_rate,
                    "admission_only": load.admission_only,
                    "resumes": load.resumes,
                    "age": round(load.age(now), 3),
                },
            }
        )
    profiles = state.planner.profiles
    report = state.prefix.report([profiles.decode, profiles.prefill])
    prefix = {
        "plugin_memory_bytes": dict(report.plugin_memory),
        "kv_event_streams": dict(report.streams),
        "index": None if report.index is None else _plain(report.index),
    }
    document: dict[str, Any] = {"mode": state.config.mode, "endpoints": endpoints, "prefix": prefix}
    if state.config.mode == "ask-all":
        document["ask_all"] = _ask_all(state, now)
    if state.shared is not None:
        document["shared_state"] = state.shared.status()
    knowledge = goodput_knowledge(state.config)
    if knowledge:
        document["goodput_starts_from"] = knowledge
        threshold = state.planner.threshold
        if threshold is not None:
            document["goodput_learnt"] = threshold.learnt()
        if state.timing:
            document["goodput_timing"] = dict(state.timing)
    return document


def _ask_all(state: GatewayState, now: float) -> dict[str, Any]:
    """The ask-all width and, when adaptive, what it chose and knows."""
    adaptive = state.planner.adaptive
    width = state.config.ask_all.width
    return {"width": width} | ({} if adaptive is None else {"adaptive": adaptive.report(now)})


def _plain(value: Any) -> Any:
    """A dataclass of plain values as a dict (for JSON)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return str(value)


def ready_document(state: GatewayState, *, draining: bool = False) -> tuple[dict[str, Any], int]:
    """``GET /ready``: ready once a health check passed and a decoder is healthy; never
    while the gateway drains (it is shutting down)."""
    fleet = state.fleet
    ready = fleet.checked_once and fleet.any_decoder_healthy() and not draining
    healthy = [s.endpoint.name for s in fleet.snapshot(Role.DECODE) if s.healthy]
    document = {"ready": ready, "draining": draining, "healthy_decoders": healthy}
    return document, 200 if ready else 503


def models_document(state: GatewayState) -> dict[str, Any]:
    """``GET /v1/models``: the models the decoders serve."""
    now = int(time.time())
    data = [
        {"id": name, "object": "model", "created": now, "owned_by": "pd-orchestrator"}
        for name in sorted(state.models)
    ]
    return {"object": "list", "data": data}
