"""Built-in filters, one table each."""

from __future__ import annotations

import dataclasses

import pytest

from pd_orchestrator.model.endpoints import Role
from pd_orchestrator.model.load import Candidate
from pd_orchestrator.policies.plugins import builtin_registry
from pd_orchestrator.routing import PluginSpec, RoutingRequest
from pd_orchestrator.routing.registry import FILTER
from tests.routing.helpers import candidate, endpoint, load, names, request

D, P, B = Role.DECODE, Role.PREFILL, Role.BOTH


def run(
    type_: str, req: RoutingRequest, candidates: list[Candidate], **params: object
) -> list[str]:
    spec = PluginSpec.model_validate({"type": type_, "params": params})
    plugin = builtin_registry().build(FILTER, spec, "test")
    return names(plugin.filter(req, candidates))


FRESH, OLD = load(at=99.0), load(at=90.0)  # requests are at now=100


@pytest.mark.parametrize(
    ("params", "candidates", "kept"),
    [
        ({}, [candidate("a"), candidate("b", healthy=False)], ["a"]),
        ({}, [candidate("a", reading=None), candidate("b", reading=OLD)], ["a", "b"]),
        ({"require_load": True}, [candidate("a"), candidate("b", reading=OLD)], ["b"]),
        (
            {"require_load": True, "max_load_age": 5},
            [candidate("a", reading=OLD), candidate("b", reading=FRESH)],
            ["b"],
        ),
        (
            {"require_load": True, "panic": False},
            [candidate("a", healthy=False, reading=FRESH)],
            [],
        ),
        ({"max_load_age": 5}, [candidate("a", reading=OLD)], ["a"]),  # ignored unless required
        ({}, [], []),
        ({}, [candidate("a", healthy=False), candidate("b", healthy=False)], ["a", "b"]),
        ({"panic": False}, [candidate("a", healthy=False)], []),
    ],
    ids=[
        "drops-unhealthy",
        "load-ignored-by-default",
        "require-load",
        "max-load-age",
        "unhealthy-with-load",
        "age-needs-require",
        "nothing",
        "panic-keeps-all-when-none-is-healthy",
        "no-panic",
    ],
)
def test_healthy(params: dict[str, object], candidates: list[Candidate], kept: list[str]) -> None:
    assert run("healthy", request(), candidates, **params) == kept


@pytest.mark.parametrize(
    ("wanted", "models", "kept"),
    [
        ("m", ["m", "n", None], ["e0", "e2"]),
        ("n", ["m", "m"], []),
        (None, ["m", "n", None], ["e0", "e1", "e2"]),
        ("m", [None, None], ["e0", "e1"]),
    ],
    ids=["match-or-any", "none-serve-it", "request-without-model", "endpoints-serve-anything"],
)
def test_model(wanted: str | None, models: list[str | None], kept: list[str]) -> None:
    candidates = [candidate(f"e{i}", model=m) for i, m in enumerate(models)]
    assert run("model", request(model=wanted), candidates) == kept


@pytest.mark.parametrize(
    ("wanted", "kept"),
    [(D, ["d", "b"]), (P, ["p", "b"]), (B, ["d", "p", "b"])],
    ids=["decode", "prefill", "both-wants-any"],
)
def test_role(wanted: Role, kept: list[str]) -> None:
    candidates = [candidate("d", D), candidate("p", P), candidate("b", B)]
    assert run("role", request(wanted), candidates) == kept


PREFILLERS = [
    candidate("p-h200", P, group="h200"),
    candidate("p-mi325x", P, group="mi325x"),
    candidate("p-other", P, group="other"),
]


@pytest.mark.parametrize(
    ("decoder_group", "params", "allowed", "kept"),
    [
        ("h200", {}, set(), ["p-h200"]),
        ("mi325x", {}, set(), ["p-mi325x"]),
        (
            "h200",
            {"pairs": [{"prefill": "mi325x", "decode": "h200"}]},
            set(),
            ["p-h200", "p-mi325x"],
        ),
        ("mi325x", {"pairs": [{"prefill": "mi325x", "decode": "h200"}]}, set(), ["p-mi325x"]),
        ("h200", {}, {("other", "h200")}, ["p-h200", "p-other"]),
        ("h200", {}, {("h200", "other")}, ["p-h200"]),
        ("nowhere", {}, set(), []),
        (None, {}, set(), ["p-h200", "p-mi325x", "p-other"]),
    ],
    ids=[
        "same-group",
        "same-group-amd",
        "declared-pair",
        "pairs-are-directed",
        "request-pair",
        "request-pair-directed",
        "no-compatible-group",
        "no-decoder-keeps-all",
    ],
)
def test_compatibility(
    decoder_group: str | None,
    params: dict[str, object],
    allowed: set[tuple[str, str]],
    kept: list[str],
) -> None:
    decoder = None if decoder_group is None else endpoint("d", group=decoder_group)
    req = request(P, decoder=decoder, allowed_pairs=frozenset(allowed))
    assert run("compatibility", req, PREFILLERS, **params) == kept


def test_filters_keep_input_order() -> None:
    candidates = [candidate(n, healthy=n != "b") for n in "dcba"]
    assert run("healthy", request(), candidates) == ["d", "c", "a"]


def _with_connector(name: str, connector: str) -> Candidate:
    ep = dataclasses.replace(endpoint(name, P), connector=connector)
    return Candidate(ep, True, 0, None)


@pytest.mark.parametrize(
    ("bridges", "kept"),
    [
        (set(), ["p-nixl"]),
        ({("nixl", "multi:nixl,offloading")}, ["p-nixl"]),
        ({("multi:nixl,offloading", "nixl")}, ["p-nixl", "p-multi"]),
    ],
    ids=["same-connector-only", "bridges-are-directed", "declared-bridge"],
)
def test_compatibility_keeps_connectors_apart_unless_bridged(
    bridges: set[tuple[str, str]], kept: list[str]
) -> None:
    decoder = dataclasses.replace(endpoint("d"), connector="nixl")
    candidates = [
        _with_connector("p-nixl", "nixl"),
        _with_connector("p-multi", "multi:nixl,offloading"),
        _with_connector("p-mooncake", "mooncake"),
    ]
    req = request(P, decoder=decoder, allowed_connector_pairs=frozenset(bridges))
    assert run("compatibility", req, candidates) == kept
