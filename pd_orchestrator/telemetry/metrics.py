"""Prometheus metrics of the gateway (one registry per gateway instance).

* ``pd_orchestrator_requests_total{endpoint,decision,code}`` -- answered requests by
  API route, decision (``decode``, ``pd`` or ``error``) and HTTP status;
* ``pd_orchestrator_decisions_total{decision}``;
* ``pd_orchestrator_handbacks_total`` -- preempted requests resubmitted mid-generation;
* ``pd_orchestrator_phase_seconds{phase}`` -- ``decode_attempt``, ``prefill``,
  ``decode`` and ``total``;
* ``pd_orchestrator_ttft_seconds`` -- arrival to the first content sent to the client;
* ``pd_orchestrator_upstream_errors_total{endpoint,kind}`` -- failures by error class,
  and what the flow did about them: ``retried`` (on another decoder before the client
  got anything), ``recovered`` (continued on another decoder mid-answer),
  ``fell_back`` (the decoder prefilled alone after the prefill side failed);
* ``pd_orchestrator_ejections_total{upstream,reason}`` -- endpoints taken out of
  rotation by outlier detection (:meth:`GatewayMetrics.count_ejection`);
* ``pd_orchestrator_in_flight_requests``;
* ``pd_orchestrator_threshold`` -- thresholds applied to decode attempts;
* ``pd_orchestrator_threshold_decisions_total{policy,reason}`` -- threshold decisions
  by the policy (instance name, or ``client``) that set them and its reason;
* ``pd_orchestrator_fanout_legs_total{outcome}``, ``pd_orchestrator_fanout_wasted_tokens_total``
  and ``pd_orchestrator_ask_all_total{outcome}`` -- the ask-all mode;
* ``pd_orchestrator_config_reloads_total{result}``.

:meth:`GatewayMetrics.record_threshold` records one threshold decision in both
threshold series. The per-request recorders (:meth:`~GatewayMetrics.record_threshold`,
:meth:`~GatewayMetrics.observe_phase`, :meth:`~GatewayMetrics.count_request`) keep
each label set's child once resolved: a label lookup per request costs more than
the increment.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

if TYPE_CHECKING:
    from pd_orchestrator.policies.base import ThresholdDecision

__all__ = ["GatewayMetrics"]

_SECONDS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
    1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
_RATIOS = tuple(i / 20 for i in range(21))


class GatewayMetrics:
    """Every metric the gateway exports, on a private registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "pd_orchestrator_requests",
            "Answered requests by API route, decision and HTTP status.",
            ["endpoint", "decision", "code"],
            registry=r,
        )
        self.decisions = Counter(
            "pd_orchestrator_decisions", "Routing decisions.", ["decision"], registry=r
        )
        self.handbacks = Counter(
            "pd_orchestrator_handbacks",
            "Preempted requests handed back and resubmitted mid-generation.",
            registry=r,
        )
        self.phase_seconds = Histogram(
            "pd_orchestrator_phase_seconds",
            "Duration of each phase of a request.",
            ["phase"],
            buckets=_SECONDS,
            registry=r,
        )
        self.ttft = Histogram(
            "pd_orchestrator_ttft_seconds",
            "Arrival to the first content sent to the client.",
            buckets=_SECONDS,
            registry=r,
        )
        self.upstream_errors = Counter(
            "pd_orchestrator_upstream_errors",
            "Failures talking to endpoints.",
            ["endpoint", "kind"],
            registry=r,
        )
        self.ejections = Counter(
            "pd_orchestrator_ejections",
            "Endpoints taken out of rotation, by endpoint and reason.",
            ["upstream", "reason"],
            registry=r,
        )
        self.in_flight = Gauge(
            "pd_orchestrator_in_flight_requests", "Client requests being served.", registry=r
        )
        self.fanout_legs = Counter(
            "pd_orchestrator_fanout_legs",
            "Ask-all legs by outcome (admitted, rejected, cancelled, failed).",
            ["outcome"],
            registry=r,
        )
        self.fanout_wasted_tokens = Counter(
            "pd_orchestrator_fanout_wasted_tokens",
            "Tokens that cancelled or unchosen ask-all legs generated for nothing.",
            registry=r,
        )
        self.ask_all = Counter(
            "pd_orchestrator_ask_all",
            "Ask-all requests by outcome (admitted, fallback_pd, fallback_local).",
            ["outcome"],
            registry=r,
        )
        self.reloads = Counter(
            "pd_orchestrator_config_reloads",
            "Configuration reloads by result (applied, refused).",
            ["result"],
            registry=r,
        )
        self.threshold = Histogram(
            "pd_orchestrator_threshold",
            "Cache-hit thresholds applied to decode attempts.",
            buckets=_RATIOS,
            registry=r,
        )
        self.threshold_decisions = Counter(
            "pd_orchestrator_threshold_decisions",
            "Threshold decisions by the policy that set them and its reason.",
            ["policy", "reason"],
            registry=r,
        )

        self._children: dict[tuple[Any, ...], Any] = {}

    def _child(self, metric: Any, *labels: str) -> Any:
        key = (id(metric), *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def record_threshold(self, decision: ThresholdDecision) -> None:
        """Count one applied threshold: its value and who chose it why."""
        self.threshold.observe(decision.value)
        self._child(self.threshold_decisions, decision.policy, decision.reason).inc()

    def observe_phase(self, phase: str, seconds: float) -> None:
        """One request's time in ``phase``."""
        self._child(self.phase_seconds, phase).observe(seconds)

    def count_request(self, route: str, decision: str, code: int) -> None:
        """One answered request (and its decision unless it failed)."""
        self._child(self.requests, route, decision, str(code)).inc()
        if decision != "error":
            self._child(self.decisions, decision).inc()

    def count_ejection(self, upstream: str, reason: str) -> None:
        """``upstream`` was taken out of rotation for ``reason`` (``consecutive_5xx``,
        ``consecutive_failures``)."""
        self._child(self.ejections, upstream, reason).inc()
