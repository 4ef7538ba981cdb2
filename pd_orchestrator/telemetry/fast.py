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
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import Generic, TypeVar

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


C = TypeVar("C", _Value, _Buckets)


class _Family(Generic[C]):
    """Children by label values, each made by ``new``; an unlabelled family is its own
    only child (so it reads 0 before its first update)."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        registry: CollectorRegistry | None,
        new: Callable[[], C],
    ) -> None:
        self.name = name
        self.documentation = documentation
        self.labelnames = tuple(labelnames)
        self._new: Callable[[], C] = new
        self._children: dict[tuple[str, ...], C] = {}
        self._seen: dict[tuple[object, ...], C] = {}
        """Children by the values as given (an ``int`` status as it came): a repeated
        update finds its child in one lookup, without making the values strings."""
        if not self.labelnames:
            self._children[()] = self._seen[()] = new()
        if registry is not None:
            registry.register(self)  # type: ignore[arg-type]

    def labels(self, *values: object) -> C:
        """The child of ``values`` (their strings are the label values); values that
        compare equal (``1`` and ``True``) share the child found first."""
        child = self._seen.get(values)
        if child is None:
            child = self._seen[values] = self._child(values)
        return child

    def _child(self, values: tuple[object, ...]) -> C:
        """The child of ``values`` made strings, made when it is new."""
        key = tuple(map(str, values))
        child = self._children.get(key)
        if child is None:
            if len(key) != len(self.labelnames):
                raise ValueError(f"{self.name}: {len(self.labelnames)} label values expected")
            child = self._children[key] = self._new()
        return child

    def clear(self) -> None:
        """Forget every labelled child (prometheus_client's ``clear``)."""
        if self.labelnames:
            self._children.clear()
            self._seen.clear()

    def describe(self) -> list[Metric]:
        return []


class _ValueFamily(_Family[_Value]):
    """A family of plain numbers; :meth:`_exposed` is its exposition type."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str] = (),
        registry: CollectorRegistry | None = None,
    ) -> None:
        super().__init__(name, documentation, labelnames, registry, _Value)

    def inc(self, amount: float = 1.0) -> None:
        self.labels().inc(amount)

    def _exposed(self) -> CounterMetricFamily | GaugeMetricFamily:
        return GaugeMetricFamily(self.name, self.documentation, labels=self.labelnames)

    def collect(self) -> Iterator[Metric]:
        family = self._exposed()
        for values, child in self._children.items():
            family.add_metric(list(values), child.value)
        yield family


class FastCounter(_ValueFamily):
    """A counter family (exposed as ``<name>_total``)."""

    def _exposed(self) -> CounterMetricFamily:
        return CounterMetricFamily(
            self.name, self.documentation, labels=self.labelnames, created=None
        )


class FastGauge(_ValueFamily):
    """A gauge family."""

    def dec(self, amount: float = 1.0) -> None:
        self.labels().dec(amount)

    def set(self, value: float) -> None:
        self.labels().set(value)


class FastHistogram(_Family[_Buckets]):
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
        super().__init__(name, documentation, labelnames, registry, partial(_Buckets, self.bounds))

    def observe(self, amount: float) -> None:
        self.labels().observe(amount)

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        edges = [*(_edge(b) for b in self.bounds), "+Inf"]
        for values, child in self._children.items():
            running = 0
            cumulative = []
            for edge, count in zip(edges, child.counts, strict=True):
                running += count
                cumulative.append((edge, float(running)))
            family.add_metric(list(values), cumulative, sum_value=child.sum)
        yield family


def _edge(bound: float) -> str:
    return repr(float(bound))
