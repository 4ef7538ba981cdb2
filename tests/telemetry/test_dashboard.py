"""The Grafana dashboard (deploy/grafana/pd-orchestrator.json): every query parses as
PromQL and names only series that exist -- the gateway's own (its registry after one
sample of each metric) or vLLM's (a simulator's ``/metrics``, which exports vLLM's
names, and the names the load scraper reads)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import promql_parser
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pd_orchestrator.fleet.scraper import LOAD_SERIES
from pd_orchestrator.model.route import at
from pd_orchestrator.telemetry.metrics import GatewayMetrics

from ..conftest import SimFactory

DASHBOARD = Path(__file__).parents[2] / "deploy" / "grafana" / "pd-orchestrator.json"
_GRAFANA_RANGES = re.compile(r"\$__(rate_interval|interval|range)\b")
_VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)")
_LABEL_VALUES = re.compile(r"^label_values\((?P<selector>.+),\s*(?P<label>\w+)\)$")


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels") or [])


def _queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target and every query variable."""
    found = []
    for panel in _panels(dashboard["panels"]):
        for target in panel.get("targets") or []:
            found.append((f"panel {panel['title']!r} {target['refId']}", target["expr"]))
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            match = _LABEL_VALUES.match(variable["query"]["query"])
            assert match, f"variable {variable['name']}: not label_values(selector, label)"
            found.append((f"variable {variable['name']}", match["selector"]))
    return found


def _as_promql(expr: str) -> str:
    """Grafana's ``$__rate_interval`` and friends as a duration, variables as a value."""
    expr = _GRAFANA_RANGES.sub("5m", expr)
    return _VARIABLE.sub("pd", expr)


def _metric_names(expr: str) -> set[str]:
    names: set[str] = set()

    def visit(node: Any) -> bool:
        if isinstance(node, promql_parser.VectorSelector):
            name = node.name or next(
                (m.value for m in node.matchers.matchers if m.name == "__name__"), None
            )
            assert name, f"a selector without a metric name in {expr}"
            names.add(name)
        return True

    promql_parser.walk(promql_parser.parse(expr), visit)
    return names


def _sample_names(text: str) -> set[str]:
    return {s.name for f in text_string_to_metric_families(text) for s in f.samples}


def gateway_series() -> set[str]:
    """Every sample name the gateway exports, once each metric has a sample."""
    metrics = GatewayMetrics()
    metrics.count_request("/v1/completions", "pd", 200)
    metrics.observe_phase("prefill", 0.01)
    metrics.record_threshold(at(0.7, "static", "fixed"))
    metrics.count_leg("d0", "decode", "ok", 0.02)
    metrics.count_upstream_error("d0", "UpstreamTimeout")
    metrics.count_resource_error("file_descriptors")
    metrics.count_kv_transfer("nixl")
    metrics.count_ejection("d0", "consecutive_errors")
    metrics.handbacks.inc()
    metrics.ttft.observe(0.1)
    metrics.itl.observe(0.01)
    metrics.in_flight.set(1)
    metrics.set_knowledge({"decode": "seeds"})
    metrics.prefill_retries.inc()
    metrics.fanout_legs.labels("admitted").inc()
    metrics.fanout_wasted_tokens.inc(3)
    metrics.ask_all.labels("admitted").inc()
    metrics.ask_all_width.labels("likely").inc()
    metrics.ask_all_prompts.labels("tokenized").inc()
    metrics.constrained.labels("admission-only").inc()
    metrics.constrained.labels("resumable").inc()
    metrics.reloads.labels("applied").inc()
    families = list(text_string_to_metric_families(generate_latest(metrics.registry).decode()))
    silent = [f.name for f in families if not f.samples]
    assert not silent, f"metrics without a sample here (record one above): {silent}"
    return {s.name for f in families for s in f.samples}


@pytest.fixture(scope="module")
def vllm_series(module_sims: SimFactory) -> set[str]:
    """vLLM's sample names: a simulator's /metrics after one P/D-shaped request, and
    the names the load scraper reads."""
    sim = module_sims("--profile", "instant", "--kv-connector", "nixl", name="vllm")
    with httpx.Client(base_url=sim.url, timeout=10) as client:
        body = {"model": "sim-model", "prompt": "warm the histograms", "max_tokens": 2}
        assert client.post("/v1/completions", json=body).status_code == 200
        text = client.get("/metrics").text
    names = _sample_names(text)
    assert "vllm:num_requests_running" in names
    return names | LOAD_SERIES


def test_the_dashboard_is_a_grafana_dashboard() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] == "pd-orchestrator" and dashboard["schemaVersion"] >= 36
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["query"] == "prometheus"
    ids = [panel["id"] for panel in _panels(dashboard["panels"])]
    assert len(ids) == len(set(ids))
    for panel in _panels(dashboard["panels"]):
        if panel["type"] != "row":
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
            assert panel["targets"], panel["title"]


def test_every_query_parses_and_names_exported_series(vllm_series: set[str]) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    known = gateway_series() | vllm_series
    used: set[str] = set()
    for where, expr in _queries(dashboard):
        try:
            names = _metric_names(_as_promql(expr))
        except ValueError as exc:
            raise AssertionError(f"{where}: not PromQL ({exc}): {expr}") from None
        unknown = names - known
        assert not unknown, f"{where} names series nobody exports: {sorted(unknown)}"
        assert names, f"{where}: no series in {expr}"
        used |= names
    # the topics the dashboard is for
    for series in (
        "pd_orchestrator_decisions_total",
        "pd_orchestrator_threshold_bucket",
        "pd_orchestrator_ttft_seconds_bucket",
        "pd_orchestrator_itl_seconds_bucket",
        "pd_orchestrator_handbacks_total",
        "pd_orchestrator_upstream_errors_total",
        "vllm:num_requests_running",
        "vllm:kv_cache_usage_perc",
    ):
        assert series in used, series


@pytest.mark.parametrize(
    "expr",
    ["sum(rate(pd_orchestrator_decisions_total[5m]", "rate(pd_orchestrator_nope_total[5m])"],
    ids=["broken-syntax", "unknown-series"],
)
def test_the_check_catches_a_bad_query(expr: str, vllm_series: set[str]) -> None:
    known = gateway_series() | vllm_series
    with pytest.raises((ValueError, AssertionError)):
        assert _metric_names(_as_promql(expr)) <= known
