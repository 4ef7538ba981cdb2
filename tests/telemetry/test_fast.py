"""The event-loop metric families expose exactly what prometheus_client's would."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pd_orchestrator.telemetry.fast import FastCounter, FastGauge, FastHistogram

BUCKETS = (0.001, 0.01, 0.1, 1.0, 10.0)


def _samples(registry: CollectorRegistry) -> set[tuple[str, tuple[tuple[str, str], ...], float]]:
    text = generate_latest(registry).decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items())), sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if not sample.name.endswith("_created")
    }


@given(
    st.lists(st.tuples(st.sampled_from(["a", "b"]), st.floats(0, 20, allow_nan=False)), max_size=40)
)
def test_histograms_and_counters_match_prometheus_client(
    observations: list[tuple[str, float]],
) -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    fast_h = FastHistogram("h_seconds", "h", ["phase"], buckets=BUCKETS, registry=ours)
    slow_h = Histogram("h_seconds", "h", ["phase"], buckets=BUCKETS, registry=theirs)
    fast_c = FastCounter("c", "c", ["phase"], registry=ours)
    slow_c = Counter("c", "c", ["phase"], registry=theirs)
    for label, value in observations:
        fast_h.labels(label).observe(value)
        slow_h.labels(label).observe(value)
        fast_c.labels(label).inc(value)
        slow_c.labels(label).inc(value)
    assert _samples(ours) == _samples(theirs)


def test_an_unlabelled_gauge_goes_up_and_down() -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    fast, slow = FastGauge("g", "g", registry=ours), Gauge("g", "g", registry=theirs)
    assert _samples(ours) == _samples(theirs)  # 0 before any update
    for gauge in (fast, slow):
        gauge.inc()
        gauge.inc(3)
        gauge.dec()
    assert _samples(ours) == _samples(theirs)


def test_unlabelled_counters_and_histograms_read_zero_before_any_update() -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    FastCounter("c", "c", registry=ours)
    Counter("c", "c", registry=theirs)
    FastHistogram("h_seconds", "h", buckets=BUCKETS, registry=ours)
    Histogram("h_seconds", "h", buckets=BUCKETS, registry=theirs)
    assert _samples(ours) == _samples(theirs)
    assert ("c_total", (), 0.0) in _samples(ours)


def test_a_value_and_its_string_update_one_child_and_clear_forgets_both() -> None:
    ours = CollectorRegistry()
    counter = FastCounter("r", "r", ["code"], registry=ours)
    counter.labels(200).inc()
    counter.labels("200").inc()
    assert counter.labels(200) is counter.labels("200")
    assert ("r_total", (("code", "200"),), 2.0) in _samples(ours)
    counter.clear()
    assert not any(name == "r_total" for name, _, _ in _samples(ours))
    counter.labels(200).inc()  # made anew after the clear
    assert ("r_total", (("code", "200"),), 1.0) in _samples(ours)


def test_the_wrong_number_of_label_values_is_refused_every_time() -> None:
    counter = FastCounter("w", "w", ["a", "b"])
    for _ in range(2):
        with pytest.raises(ValueError, match="2 label values expected"):
            counter.labels("only-one")
