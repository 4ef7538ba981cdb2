"""What one load poll costs the gateway's event loop: reading a vLLM ``/metrics`` text.

The load scraper parses each endpoint's ``/metrics`` once per ``load.interval`` on
the event loop that relays every stream. This times
:func:`~pd_orchestrator.fleet.scraper.parse_metrics` (the load series only) against
the Prometheus parser over the whole text (what the scraper did before), in one
invocation, on a vLLM-shaped text: a file saved from a server (``--file``, e.g.
``curl -s DECODER/metrics > m.txt``) or a generated one (``--histograms`` families
of 40 buckets beside the load series). It prints the lines, the median time of each
and their ratio.

    .venv/bin/python benchmarks/metrics_parse.py [--file m.txt] [--histograms 16]
        [--repeats 200]
"""

from __future__ import annotations

import argparse
import statistics
import timeit
from collections.abc import Callable
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from pd_orchestrator.fleet.scraper import parse_metrics

LOAD_SERIES = {
    "vllm:num_requests_running": 2.0,
    "vllm:num_requests_waiting": 1.0,
    "vllm:kv_cache_usage_perc": 0.25,
    "vllm:prefix_cache_queries_total": 100.0,
    "vllm:prefix_cache_hits_total": 40.0,
    "vllm:num_preemptions_total": 3.0,
}
LABELS = 'engine="0",model_name="m"'


def generated(histograms: int) -> str:
    """The load series and ``histograms`` histogram families of 40 buckets each."""
    lines = [f"{name}{{{LABELS}}} {value}" for name, value in LOAD_SERIES.items()]
    for n in range(histograms):
        name = f"vllm:histogram_{n}_seconds"
        lines += [f"# HELP {name} A histogram.", f"# TYPE {name} histogram"]
        lines += [f'{name}_bucket{{{LABELS},le="{2**i}"}} {i}.0' for i in range(40)]
        lines += [f"{name}_sum{{{LABELS}}} 1.0", f"{name}_count{{{LABELS}}} 2.0"]
    return "\n".join(lines) + "\n"


def whole(text: str) -> None:
    """The Prometheus parser over every family and sample of ``text``."""
    for family in text_string_to_metric_families(text):
        for _sample in family.samples:
            pass


def median_seconds(work: Callable[[], object], repeats: int) -> float:
    """Median seconds of one call over ``repeats`` (the garbage collector on)."""
    return statistics.median(timeit.repeat(work, "gc.enable()", number=1, repeat=repeats))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--file", type=Path, default=None)
    parser.add_argument("--histograms", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    text = args.file.read_text() if args.file else generated(args.histograms)
    model = None if args.file else "m"
    load = median_seconds(lambda: parse_metrics(text, model), args.repeats)
    full = median_seconds(lambda: whole(text), args.repeats)
    print(f"{len(text.splitlines())} lines, {len(text):,} bytes")
    print(f"parse_metrics (load series):  {load * 1000:8.3f} ms")
    print(f"whole text (Prometheus parser): {full * 1000:8.3f} ms")
    print(f"ratio: {load / full:.3f}x")


if __name__ == "__main__":
    main()
