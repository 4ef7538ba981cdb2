"""Built-in scorers, one table each (raw scores, before the engine's weights)."""

from __future__ import annotations

import pytest

from pd_orchestrator.model.load import Candidate, LoadSnapshot
from pd_orchestrator.policies.plugins import builtin_registry
from pd_orchestrator.routing import PluginSpec
from pd_orchestrator.routing.registry import SCORER
from pd_orchestrator.routing.scorers import queue_depth
from tests.routing.helpers import candidate, load, request


def scores(type_: str, candidates: list[Candidate], **params: object) -> list[float]:
    spec = PluginSpec.model_validate({"type": type_, "params": params})
    plugin = builtin_registry().build(SCORER, spec, "test")
    return [round(s, 6) for s in plugin.score(request(), candidates)]


@pytest.mark.parametrize(
    ("candidates", "expected"),
    [
        ([candidate("a", reading=load(1, 1)), candidate("b", reading=load(4, 2))], [1.0, 0.0]),
        (
            [
                candidate("a", reading=load(0)),
                candidate("b", reading=load(2, 1)),
                candidate("c", reading=load(6)),
            ],
            [1.0, 0.5, 0.0],
        ),
        ([candidate("a", reading=load(3)), candidate("b", reading=load(1, 2))], [1.0, 1.0]),
        ([candidate("a", in_flight=4), candidate("b", in_flight=0)], [0.0, 1.0]),
        (
            [candidate("a", in_flight=5, reading=load(0)), candidate("b", reading=load(2))],
            [0.0, 1.0],
        ),
        (
            [candidate("a", in_flight=1, reading=load(4)), candidate("b", reading=load(2))],
            [0.0, 1.0],
        ),
        ([candidate("a", reading=load(7))], [1.0]),
        ([], []),
    ],
    ids=[
        "running-plus-waiting",
        "min-max-normalised",
        "equal-depths",
        "in-flight-without-reading",
        "in-flight-above-reading",
        "reading-above-in-flight",
        "single",
        "none",
    ],
)
def test_queue_depth(candidates: list[Candidate], expected: list[float]) -> None:
    assert scores("queue-depth", candidates) == expected


@pytest.mark.parametrize(
    ("in_flight", "reading", "depth"),
    [(3, None, 3), (3, load(1, 1), 3), (1, load(2, 3), 5), (0, load(0, 0), 0)],
    ids=["no-reading", "in-flight-larger", "reading-larger", "idle"],
)
def test_queue_depth_of_one_candidate(
    in_flight: int, reading: LoadSnapshot | None, depth: int
) -> None:
    assert queue_depth(candidate("a", in_flight=in_flight, reading=reading)) == depth


@pytest.mark.parametrize(
    ("params", "candidates", "expected"),
    [
        (
            {},
            [candidate("a", reading=load(kv=0.25)), candidate("b", reading=load(kv=1.0))],
            [0.75, 0.0],
        ),
        ({}, [candidate("a", reading=load(kv=0.0)), candidate("b")], [1.0, 0.5]),
        ({"missing": 0.0}, [candidate("a")], [0.0]),
        ({"missing": 1.0}, [candidate("a")], [1.0]),
    ],
    ids=["one-minus-usage", "missing-default", "missing-pessimistic", "missing-optimistic"],
)
def test_kv_usage(
    params: dict[str, object], candidates: list[Candidate], expected: list[float]
) -> None:
    assert scores("kv-usage", candidates, **params) == expected


HW = [
    candidate("a", hardware="h200"),
    candidate("b", hardware="mi325x"),
    candidate("c", hardware="tpu"),
]


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        ({}, [1.0, 1.0, 1.0]),
        ({"weights": {"h200": 1.0, "mi325x": 0.9}}, [1.0, 0.9, 1.0]),
        ({"weights": {"h200": 4.0, "mi325x": 2.0}}, [1.0, 0.5, 0.25]),
        ({"weights": {"h200": 2.0}, "default": 0.0}, [1.0, 0.0, 0.0]),
        ({"weights": {"mi325x": 0.5}, "default": 0.25}, [0.5, 1.0, 0.5]),
        ({"weights": {"h200": 0.0}, "default": 0.0}, [0.0, 0.0, 0.0]),
    ],
    ids=[
        "default-equal",
        "preference",
        "normalised-by-largest",
        "unlisted-excluded",
        "default-below-listed",
        "all-zero",
    ],
)
def test_hardware_weight(params: dict[str, object], expected: list[float]) -> None:
    assert scores("hardware-weight", HW, **params) == expected
