"""``pd-orchestrator top``: a live terminal view of a running gateway.

Every ``--interval`` seconds it reads the gateway's ``/status`` (endpoints by
name: health, in-flight requests, running, waiting, KV usage, prefix hit rate)
and ``/metrics`` (decisions, hand-backs, applied thresholds), and shows rates
over the last interval. ``--once`` prints one frame of totals and exits.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

__all__ = ["Sample", "add_parser", "parse_sample", "render"]


@dataclass(frozen=True)
class Sample:
    """One reading of a gateway: its ``/status`` document and counters, at ``taken``."""

    taken: float
    status: dict[str, Any]
    decisions: dict[str, float] = field(default_factory=dict)
    handbacks: float = 0.0
    thresholds: dict[float, float] = field(default_factory=dict)
    errors: float = 0.0


def parse_sample(taken: float, status: dict[str, Any], metrics_text: str) -> Sample:
    """A :class:`Sample` from ``/status`` and the Prometheus text of ``/metrics``."""
    decisions: dict[str, float] = defaultdict(float)
    buckets: dict[float, float] = {}
    handbacks = errors = 0.0
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == "pd_orchestrator_decisions_total":
                decisions[sample.labels["decision"]] += sample.value
            elif sample.name == "pd_orchestrator_handbacks_total":
                handbacks += sample.value
            elif sample.name == "pd_orchestrator_threshold_bucket":
                buckets[float(sample.labels["le"])] = sample.value
            elif sample.name == "pd_orchestrator_requests_total":
                errors += sample.value if sample.labels.get("decision") == "error" else 0.0
    return Sample(taken, status, dict(decisions), handbacks, _per_bucket(buckets), errors)


def _per_bucket(cumulative: dict[float, float]) -> dict[float, float]:
    previous = 0.0
    counts = {}
    for bound in sorted(cumulative):
        if bound == float("inf"):
            continue
        counts[bound] = cumulative[bound] - previous
        previous = cumulative[bound]
    return counts


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def _endpoints(status: dict[str, Any]) -> Table:
    table = Table(title=f"endpoints ({status.get('mode', '?')})", expand=True)
    for column in ("name", "pool", "role", "hw", "health", "in flight", "running", "waiting",
                   "KV", "prefix hits"):  # fmt: skip
        table.add_column(column, justify="left" if column in ("name", "pool") else "right")
    for e in status.get("endpoints", []):
        load = e.get("load") or {}
        health = Text("up", style="green") if e["healthy"] else Text("DOWN", style="bold red")
        table.add_row(
            e["name"], e["pool"], e["role"], e["hardware"], health, str(e["in_flight"]),
            str(load.get("running", "-")), str(load.get("waiting", "-")),
            _percent(load.get("kv_usage")), _percent(load.get("prefix_hit_rate")),
        )  # fmt: skip
    return table


def _decisions(now: Sample, before: Sample | None) -> Table:
    seconds = (now.taken - before.taken) if before is not None else 0.0
    table = Table(title="decisions", expand=True)
    for column in ("kind", "total", "per second"):
        table.add_column(column, justify="right")
    rows = [(k, v, before.decisions.get(k, 0.0) if before else v) for k, v in now.decisions.items()]
    rows.append(("hand-backs", now.handbacks, before.handbacks if before else now.handbacks))
    rows.append(("errors", now.errors, before.errors if before else now.errors))
    for kind, total, previous in sorted(rows):
        rate = (total - previous) / seconds if seconds > 0 else 0.0
        table.add_row(kind, f"{total:.0f}", f"{rate:.1f}")
    return table


def _thresholds(sample: Sample, width: int = 30) -> Table:
    table = Table(title="applied thresholds", expand=True)
    table.add_column("<= threshold", justify="right")
    table.add_column("requests", justify="right")
    table.add_column("")
    peak = max(sample.thresholds.values(), default=0.0) or 1.0
    for bound, count in sorted(sample.thresholds.items()):
        if count:
            table.add_row(f"{bound:.2f}", f"{count:.0f}", "#" * max(1, int(width * count / peak)))
    return table


def render(now: Sample, before: Sample | None) -> RenderableType:
    """One frame: endpoints, decisions (rates over ``before`` -> ``now``), thresholds."""
    return Group(_endpoints(now.status), _decisions(now, before), _thresholds(now))


def _read(client: httpx.Client) -> Sample:
    status = client.get("/status").json()
    metrics = client.get("/metrics").text
    return parse_sample(time.monotonic(), status, metrics)


def run(args: argparse.Namespace) -> int:
    console = Console()
    with httpx.Client(base_url=args.url, timeout=5) as client:
        try:
            sample = _read(client)
        except httpx.HTTPError as exc:
            console.print(f"[bold red]error:[/] cannot read {args.url}: {exc}")
            return 1
        if args.once:
            console.print(render(sample, None))
            return 0
        with Live(render(sample, None), console=console, refresh_per_second=4) as live:
            while True:
                time.sleep(args.interval)
                previous, sample = sample, _read(client)
                live.update(render(sample, previous))


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("top", help="live view of a running gateway")
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the gateway")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between readings")
    parser.add_argument("--once", action="store_true", help="print one frame and exit")
    parser.set_defaults(handler=run)
