"""Prometheus metrics of the gateway (one registry per gateway instance).

* ``pd_orchestrator_requests_total{route,decision,code}`` -- answered requests by
  API route, decision (``decode``, ``pd``, ``error``; ``none`` on ``/tokenize`` and
  ``/detokenize``) and HTTP status;
* ``pd_orchestrator_decisions_total{decision}``;
* ``pd_orchestrator_handbacks_total`` -- preempted requests resubmitted mid-generation;
* ``pd_orchestrator_phase_seconds{phase}`` -- ``decode_attempt``, ``prefill``,
  ``decode`` and ``total``;
* ``pd_orchestrator_ttft_seconds`` -- arrival to the first content sent to the client;
* ``pd_orchestrator_itl_seconds`` -- a request's mean gap between later content (ITL);
* ``pd_orchestrator_upstream_requests_total{upstream,phase,outcome}`` -- every
  upstream request (leg) by endpoint name, phase and outcome: ``ok`` (answered: a
  whole answer, or a stream read to its end), ``rejected`` (a streamed decode
  attempt answered ``cache_threshold`` without a token), ``cancelled`` (closed by
  the gateway before its end: a losing ask-all leg, a client that left) or the
  failure (``unavailable``, ``timeout``, ``http_4xx``, ``http_5xx``, ``protocol``);
* ``pd_orchestrator_upstream_seconds{upstream,phase}`` -- from sending a leg to the
  end of its answer (a stream: until it was read to its end or closed); failed legs
  are not observed;
* ``pd_orchestrator_upstream_errors_total{upstream,kind}`` -- failures by endpoint
  and error class, and what the flow did about them: ``retried`` (on another decoder
  before the client got anything), ``recovered`` (continued on another decoder
  mid-answer), ``fell_back`` (the decoder prefilled alone after the prefill side failed);
* ``pd_orchestrator_gateway_resource_errors_total{resource}`` -- upstream connections
  the gateway could not open, and client connections it could not accept, because
  it ran out of its own ``file_descriptors``, ``socket_buffers`` or ``memory``
  (never counted against an endpoint);
* ``pd_orchestrator_prefill_retries_total`` -- prefill legs sent again after a failed one;
* ``pd_orchestrator_kv_transfers_total{connector}`` -- P/D hand-overs: decode legs
  sent with a prefiller's KV transfer parameters, by the decoder's connector;
* ``pd_orchestrator_ejections_total{upstream,reason}`` -- endpoints taken out of
  rotation by outlier detection (:meth:`GatewayMetrics.count_ejection`);
* ``pd_orchestrator_in_flight_requests``;
* ``pd_orchestrator_threshold`` -- thresholds applied to decode attempts;
* ``pd_orchestrator_constrained_requests_total{threshold}`` -- requests with tools,
  structured outputs or logprobs: sent ``resumable`` (the policy's threshold, handed
  back and continued with their grammar advanced), ``admission-only`` or with ``zero``;
* ``pd_orchestrator_threshold_decisions_total{policy,reason}`` -- threshold decisions
  by the policy (instance name, or ``client``) that set them and its reason;
* ``pd_orchestrator_fanout_legs_total{outcome}``, ``pd_orchestrator_fanout_wasted_tokens_total``,
  ``pd_orchestrator_ask_all_total{outcome}``, ``pd_orchestrator_ask_all_asked`` (decoders
  asked per request), ``pd_orchestrator_ask_all_width_total{reason}`` and
  ``pd_orchestrator_ask_all_prompts_total{form}`` (how the prompt went to the asked
  decoders) -- the ask-all mode;
* ``pd_orchestrator_config_reloads_total{result}``;
* ``process_*`` -- CPU, memory, open files and start time of the gateway's process.

Endpoint labels are named ``upstream`` and routes ``route``: ``endpoint`` is the
label the Prometheus Operator gives every scraped target. Counters export no
``_created`` series. The families are the event loop's own
(:mod:`~pd_orchestrator.telemetry.fast`): no lock and a few Python calls per update.

:meth:`GatewayMetrics.record_threshold` records one threshold decision in both
threshold series. The per-request recorders (:meth:`~GatewayMetrics.record_threshold`,
:meth:`~GatewayMetrics.observe_phase`, :meth:`~GatewayMetrics.count_request`,
:meth:`~GatewayMetrics.count_leg`) keep each label set's child once resolved: a
label lookup per request costs more than the increment. Endpoint names a request
brings itself (a sidecar header's ``host:port``) get their own label up to
``sidecar.max_named_targets`` of them, then ``other``
(:meth:`GatewayMetrics.label_upstreams`): no client can grow the label set without
bound.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, ProcessCollector, disable_created_metrics

from pd_orchestrator.model.route import Route, threshold_of
from pd_orchestrator.telemetry.fast import FastCounter as Counter
from pd_orchestrator.telemetry.fast import FastGauge as Gauge
from pd_orchestrator.telemetry.fast import FastHistogram as Histogram

__all__ = ["OTHER_UPSTREAM", "GatewayMetrics"]

OTHER_UPSTREAM = "other"
"""The ``upstream`` label of header-named targets past ``sidecar.max_named_targets``."""

disable_created_metrics()  # type: ignore[no-untyped-call]

_SECONDS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
    1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
_ITL_SECONDS = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
    0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5,
)  # fmt: skip
_RATIOS = tuple(i / 20 for i in range(21))


class GatewayMetrics:
    """Every metric the gateway exports, on a private registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        ProcessCollector(registry=r)
        self.requests = Counter(
            "pd_orchestrator_requests",
            "Answered requests by API route, decision and HTTP status.",
            ["route", "decision", "code"],
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
        self.itl = Histogram(
            "pd_orchestrator_itl_seconds",
            "Mean gap between the pieces of content sent to the client after the first, "
            "per request.",
            buckets=_ITL_SECONDS,
            registry=r,
        )
        self.upstream_requests = Counter(
            "pd_orchestrator_upstream_requests",
            "Upstream requests (legs) by endpoint, phase and outcome.",
            ["upstream", "phase", "outcome"],
            registry=r,
        )
        self.upstream_seconds = Histogram(
            "pd_orchestrator_upstream_seconds",
            "From sending an upstream request to the end of its answer (failed legs excluded).",
            ["upstream", "phase"],
            buckets=_SECONDS,
            registry=r,
        )
        self.upstream_errors = Counter(
            "pd_orchestrator_upstream_errors",
            "Failures talking to endpoints, by endpoint and error class.",
            ["upstream", "kind"],
            registry=r,
        )
        self.resource_errors = Counter(
            "pd_orchestrator_gateway_resource_errors",
            "Connections the gateway could not open or accept for want of its own resources.",
            ["resource"],
            registry=r,
        )
        self.prefill_retries = Counter(
            "pd_orchestrator_prefill_retries",
            "Prefill legs sent again after a failed prefill leg.",
            registry=r,
        )
        self.kv_transfers = Counter(
            "pd_orchestrator_kv_transfers",
            "P/D hand-overs: decode legs sent with KV transfer parameters, by connector.",
            ["connector"],
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
        self.policy_knowledge = Gauge(
            "pd_orchestrator_policy_knowledge",
            "1 per pool a goodput policy runs on, labelled with what its cost model starts "
            "from: measured (the pool's profile file), simulator (a simulator's own "
            "profile) or seeds (conservative seeds, learnt from traffic).",
            ["pool", "source"],
            registry=r,
        )
        self.shared_connected = Gauge(
            "pd_orchestrator_shared_state_connected",
            "1 while the NATS server of shared_state is reachable (the gateway adds the "
            "other gateways' load to its own), 0 while it counts its own state only.",
            registry=r,
        )
        self.shared_peers = Gauge(
            "pd_orchestrator_shared_state_peers",
            "Other gateways whose load this gateway counts (their reports younger than "
            "shared_state.ttl).",
            registry=r,
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
            "Ask-all requests by outcome (admitted, fallback_pd, fallback_local, skipped: "
            "no decoder asked, straight to the fallback).",
            ["outcome"],
            registry=r,
        )
        self.ask_all_asked = Histogram(
            "pd_orchestrator_ask_all_asked",
            "Decoders asked per ask-all request.",
            buckets=(0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64),
            registry=r,
        )
        self.ask_all_width = Counter(
            "pd_orchestrator_ask_all_width",
            "Ask-all requests by why they asked whom they asked (fixed; adaptive: likely, "
            "unknown, explore, cold, short, no-threshold).",
            ["reason"],
            registry=r,
        )
        self.ask_all_prompts = Counter(
            "pd_orchestrator_ask_all_prompts",
            "Ask-all requests asking at least ask_all.tokenize_from decoders, by how the "
            "prompt went to them: tokenized (one /tokenize, then token ids), reused (ids "
            "the gateway had), failed (the /tokenize failed: text), text (a request that "
            "keeps its text).",
            ["form"],
            registry=r,
        )
        self.constrained = Counter(
            "pd_orchestrator_constrained_requests",
            "Requests with tools, structured outputs or logprobs, by how their threshold "
            "went: resumable (the policy's; a structured output handed back is continued "
            "with its grammar advanced), admission-only (the policy's, never handed back) "
            "or zero (a decoder they may go to cannot take admission-only).",
            ["threshold"],
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

        self._legs: dict[tuple[str, str, str], tuple[Any, Any]] = {}
        self._configured: frozenset[str] = frozenset()
        self._named: set[str] = set()
        self._max_named = 256

    def set_knowledge(self, sources: dict[str, str]) -> None:
        """Per pool, what its goodput model starts from (``pool -> source``; the gauge
        holds these pools only, so a reload drops the pools it no longer has)."""
        self.policy_knowledge.clear()
        for pool, source in sources.items():
            self.policy_knowledge.labels(pool, source).set(1)

    def set_shared(self, connected: bool, peers: int) -> None:
        """Whether the shared state's server is reachable, and how many other gateways
        count."""
        self.shared_connected.set(1 if connected else 0)
        self.shared_peers.set(peers)

    def label_upstreams(self, configured: set[str], max_named: int) -> None:
        """The endpoint names that are configured (each has its own ``upstream`` label),
        and how many other names (a sidecar header's ``host:port``) get one of their
        own before the rest are counted as ``other`` (the label set stays bounded)."""
        self._configured = frozenset(configured)
        self._max_named = max_named

    def _upstream(self, name: str) -> str:
        if name in self._configured or name in self._named:
            return name
        if len(self._named) < self._max_named:
            self._named.add(name)
            return name
        return OTHER_UPSTREAM

    def record_threshold(self, route: Route) -> None:
        """Count one route: the threshold it sends and who chose it why."""
        self.threshold.observe(threshold_of(route))
        self.threshold_decisions.labels(route.policy, route.reason).inc()

    def observe_phase(self, phase: str, seconds: float) -> None:
        """One request's time in ``phase``."""
        self.phase_seconds.labels(phase).observe(seconds)

    def count_request(self, route: str, decision: str, code: int) -> None:
        """One answered request (and its decision unless it failed, or its route decides
        nothing: ``none``)."""
        self.requests.labels(route, decision, str(code)).inc()
        if decision != "error" and decision != "none":
            self.decisions.labels(decision).inc()

    def count_leg(self, upstream: str, phase: str, outcome: str, seconds: float | None) -> None:
        """One upstream request that ended with ``outcome``; ``seconds`` (when given)
        is its time from sending to the end of its answer."""
        key = (upstream, phase, outcome)
        children = self._legs.get(key)
        if children is None:
            upstream = self._upstream(upstream)
            children = self._legs.setdefault(
                (upstream, phase, outcome),
                (
                    self.upstream_requests.labels(upstream, phase, outcome),
                    self.upstream_seconds.labels(upstream, phase),
                ),
            )
        children[0].inc()
        if seconds is not None:
            children[1].observe(seconds)

    def count_upstream_error(self, upstream: str, kind: str) -> None:
        """One failure talking to ``upstream`` (``kind``: the error's class)."""
        self.upstream_errors.labels(self._upstream(upstream), kind).inc()

    def count_resource_error(self, resource: str) -> None:
        """The gateway ran out of its own ``resource`` opening an upstream connection."""
        self.resource_errors.labels(resource).inc()

    def count_kv_transfer(self, connector: str) -> None:
        """One decode leg sent with KV transfer parameters through ``connector``."""
        self.kv_transfers.labels(connector).inc()

    def count_ejection(self, upstream: str, reason: str) -> None:
        """``upstream`` was taken out of rotation for ``reason`` (``consecutive_5xx``,
        ``consecutive_failures``)."""
        self.ejections.labels(self._upstream(upstream), reason).inc()
