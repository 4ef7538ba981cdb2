"""Prometheus metrics of a simulated instance, under vLLM's ``vllm:`` names.

Gauges and counters are read from the engine at scrape time (one source of truth);
latency histograms are observed by the HTTP layer. Every metric carries the
``model_name`` and ``engine`` labels vLLM uses. Simulator-only series:
``vllm:cache_threshold_rejections_total{phase}`` (``admission`` or ``preemption``,
the same series the project's vLLM plugin exports) and
``vllm:prefill_tokens_computed_total`` (prompt tokens actually computed, i.e.
not served from a cache), ``vllm:cache_threshold_admission_only`` (1: the
plugin honours ``cache_hit_admission_only``, as the project's plugin exports it;
``vllm:cache_threshold_resume`` alongside it) and
``vllm:prompt_tokens_tokenized_total`` (prompt tokens the
API server tokenized: text prompts, rendered chats and ``/tokenize``; a token-id
prompt costs none).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pd_orchestrator.sim.engine import Engine

__all__ = ["SimMetrics"]

_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip


class _EngineCollector(Collector):
    def __init__(self, engine: Engine, labels: dict[str, str], admission_only: bool) -> None:
        self.engine = engine
        self.labels = labels
        self.admission_only = admission_only

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, doc, labels=list(self.labels))
        family.add_metric(list(self.labels.values()), value)
        return family

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(name, doc, labels=list(self.labels))
        family.add_metric(list(self.labels.values()), value)
        return family

    def collect(self) -> Iterator[Metric]:
        engine, stats = self.engine, self.engine.stats
        yield self._gauge("vllm:num_requests_running", "Requests running.", engine.num_running)
        yield self._gauge("vllm:num_requests_waiting", "Requests waiting.", engine.num_waiting)
        yield self._gauge("vllm:kv_cache_usage_perc", "KV-cache usage (0..1).", engine.pool.usage)
        yield self._counter(
            "vllm:prefix_cache_queries", "Prompt tokens queried.", stats.prefix_queries
        )
        yield self._counter("vllm:prefix_cache_hits", "Prompt tokens hit.", stats.prefix_hits)
        yield self._counter(
            "vllm:external_prefix_cache_queries",
            "Tokens queried from the KV connector.",
            stats.external_queries,
        )
        yield self._counter(
            "vllm:external_prefix_cache_hits",
            "Tokens loaded through the KV connector.",
            stats.external_hits,
        )
        yield self._counter("vllm:num_preemptions", "Preemptions.", stats.preemptions)
        yield self._counter("vllm:prompt_tokens", "Prompt tokens admitted.", stats.prompt_tokens)
        yield self._counter(
            "vllm:prefill_tokens_computed",
            "Prompt tokens computed (not from a cache).",
            stats.prefill_computed_tokens,
        )
        yield self._counter("vllm:generation_tokens", "Tokens generated.", stats.generation_tokens)
        yield self._counter(
            "vllm:prompt_tokens_tokenized",
            "Prompt tokens the API server tokenized.",
            stats.tokenized_tokens,
        )
        yield self._finished(stats.finished)
        yield self._rejections()
        if self.admission_only:
            yield self._gauge(
                "vllm:cache_threshold_admission_only",
                "1: the threshold plugin honours cache_hit_admission_only.",
                1.0,
            )
            yield self._gauge(
                "vllm:cache_threshold_resume",
                "1: the threshold plugin honours cache_hit_resume_tokens.",
                1.0,
            )

    def _finished(self, finished: dict[str, int]) -> CounterMetricFamily:
        family = CounterMetricFamily(
            "vllm:request_success",
            "Finished requests by finish reason.",
            labels=[*self.labels, "finished_reason"],
        )
        for reason, count in sorted(finished.items()):
            family.add_metric([*self.labels.values(), reason], count)
        return family

    def _rejections(self) -> CounterMetricFamily:
        stats = self.engine.stats
        family = CounterMetricFamily(
            "vllm:cache_threshold_rejections",
            "Requests finished with cache_threshold, by phase.",
            labels=[*self.labels, "phase"],
        )
        values = self.labels.values()
        family.add_metric([*values, "admission"], stats.threshold_rejections_admission)
        family.add_metric([*values, "preemption"], stats.threshold_rejections_preemption)
        return family


class SimMetrics:
    """A registry per simulated instance (never the process-global one)."""

    def __init__(
        self, engine: Engine, model: str, engine_id: str, *, admission_only: bool = True
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        labels = {"model_name": model, "engine": engine_id}
        self.registry.register(_EngineCollector(engine, labels, admission_only))
        names = list(labels)
        self._values = list(labels.values())
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Time to first token.",
            names,
            registry=self.registry,
            buckets=_LATENCY_BUCKETS,
        )
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "End-to-end request latency.",
            names,
            registry=self.registry,
            buckets=_LATENCY_BUCKETS,
        )
        self.nixl_xfer = Histogram(
            "vllm:nixl_xfer_time_seconds",
            "KV pull time over the (simulated) NIXL side channel.",
            names,
            registry=self.registry,
            buckets=_LATENCY_BUCKETS,
        )
        self.nixl_bytes = Histogram(
            "vllm:nixl_bytes_transferred",
            "KV bytes pulled per transfer.",
            names,
            registry=self.registry,
            buckets=tuple(float(4**k * 1024) for k in range(2, 14)),
        )

    def observe_ttft(self, seconds: float) -> None:
        self.ttft.labels(*self._values).observe(seconds)

    def observe_e2e(self, seconds: float) -> None:
        self.e2e.labels(*self._values).observe(seconds)

    def observe_transfer(self, seconds: float, num_bytes: int) -> None:
        self.nixl_xfer.labels(*self._values).observe(seconds)
        self.nixl_bytes.labels(*self._values).observe(num_bytes)
