"""Counters, gauges and histograms for metrics written on every request.

prometheus_client's metric objects take a lock on every update and walk a few
Python layers per call; a request of the gateway records about fifteen updates,
which cost more than the rest of its bookkeeping. These families keep plain
numbers instead: every update happens on the gateway's event loop (one thread), and
the exposition (``GET /metrics``, on the same loop) reads them through
:meth:`collect`, as any prometheus_client collector is read. Same surface as
prometheus_client's: ``labels(*values)`` (children are kept once made), ``inc``,
``dec``, ``set``, ``observe``. No ``_created`` series.

Not for metrics written from other threads.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator, Sequence

from prometheus_client.core import (
    CollectorRegistry,
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

__all__ = ["FastCounter", "FastGauge", "FastHistogram"]


class _Value:
    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0.0

    def inc(self, amount: float = 1.0) -> None:
        self.value += amount

    def dec(self, amount: float = 1.0) -> None:
        self.value -= amount

    def set(self, value: float) -> None:
        self.value = value


class _Buckets:
    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one: +Inf
        self.sum = 0.0

    def observe(self, amount: float) -> None:
        self.counts[bisect_left(self.bounds, amount)] += 1
        self.sum += amount


class _Family:
    """Children by label values; an unlabelled family is its own only child."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str] = (),
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._children: dict[tuple[str, ...], object] = {}
        if not self.labelnames:
            self._children[()] = self._new()  # reads 0 before its first update
        if registry is not None:
            registry.register(self)  # type: ignore[arg-type]

    def _new(self) -> object:
        raise NotImplementedError

    def _child(self, values: tuple[str, ...]) -> object:
        child = self._children.get(values)
        if child is None:
            if len(values) != len(self.labelnames):
                raise ValueError(f"{self.name}: {len(self.labelnames)} label values expected")
            child = self._children[values] = self._new()
        return child

    def describe(self) -> list[Metric]:
        return []


class FastCounter(_Family):
    """A counter family (exposed as ``<name>_total``)."""

    def _new(self) -> _Value:
        return _Value()

    def labels(self, *values: str) -> _Value:
        child = self._child(tuple(str(v) for v in values))
        assert isinstance(child, _Value)
        return child

    def inc(self, amount: float = 1.0) -> None:
        self.labels().inc(amount)

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            self.name, self.documentation, labels=self.labelnames, created=None
        )
        for values, child in self._children.items():
            assert isinstance(child, _Value)
            family.add_metric(list(values), child.value)
        yield family


class FastGauge(_Family):
    """A gauge family."""

    def _new(self) -> _Value:
        return _Value()

    def labels(self, *values: str) -> _Value:
        child = self._child(tuple(str(v) for v in values))
        assert isinstance(child, _Value)
        return child

    def inc(self, amount: float = 1.0) -> None:
        self.labels().inc(amount)

    def dec(self, amount: float = 1.0) -> None:
        self.labels().dec(amount)

    def set(self, value: float) -> None:
        self.labels().set(value)

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for values, child in self._children.items():
            assert isinstance(child, _Value)
            family.add_metric(list(values), child.value)
        yield family


class FastHistogram(_Family):
    """A histogram family with the given upper bounds (``+Inf`` is added)."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str] = (),
        *,
        buckets: Sequence[float],
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.bounds = tuple(sorted(float(b) for b in buckets if b != float("inf")))
        super().__init__(name, documentation, labelnames, registry)

    def _new(self) -> _Buckets:
        return _Buckets(self.bounds)

    def labels(self, *values: str) -> _Buckets:
        child = self._child(tuple(str(v) for v in values))
        assert isinstance(child, _Buckets)
        return child

    def observe(self, amount: float) -> None:
        self.labels().observe(amount)

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        edges = [*(_edge(b) for b in self.bounds), "+Inf"]
        for values, child in self._children.items():
            assert isinstance(child, _Buckets)
            running = 0
            cumulative = []
            for edge, count in zip(edges, child.counts, strict=True):
                running += count
                cumulative.append((edge, float(running)))
            family.add_metric(list(values), cumulative, sum_value=child.sum)
        yield family


def _edge(bound: float) -> str:
    return repr(float(bound))
