"""Every threshold decision is observable: histogram and counter by policy and reason."""

from __future__ import annotations

from pd_orchestrator.model.route import at
from pd_orchestrator.telemetry.metrics import GatewayMetrics


def test_record_threshold_counts_by_policy_and_reason() -> None:
    metrics = GatewayMetrics()
    for decision in (
        at(0.95, "load-adaptive", "decoder-busy"),
        at(0.9, "load-adaptive", "decoder-busy"),
        at(0.2, "client", "client-supplied"),
    ):
        metrics.record_threshold(decision)
    sample = metrics.registry.get_sample_value
    counter = "pd_orchestrator_threshold_decisions_total"
    busy = {"policy": "load-adaptive", "reason": "decoder-busy"}
    assert sample(counter, busy) == 2.0
    assert sample(counter, {"policy": "client", "reason": "client-supplied"}) == 1.0
    assert sample("pd_orchestrator_threshold_count") == 3.0
    assert sample("pd_orchestrator_threshold_sum") == 0.95 + 0.9 + 0.2
    assert sample("pd_orchestrator_threshold_bucket", {"le": "0.25"}) == 1.0
