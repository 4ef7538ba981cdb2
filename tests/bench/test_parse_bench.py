"""``benchmarks/parse_bench.py`` times like for like: its msgspec structs accept the
bodies the gateway's models accept, read the same values, and reject what they reject."""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType
from typing import Any

import msgspec
import orjson
import pytest

from pd_orchestrator.openai.protocol import RequestError, parse_for
from tests.bench.scripts import benchmark_script


@pytest.fixture(scope="module")
def bench() -> Iterator[ModuleType]:
    with benchmark_script("parse_bench") as module:
        yield module


FIELDS = ("model", "max_tokens", "n", "stream", "cache_hit_threshold", "cache_hit_admission_only")


def test_every_way_reads_the_same_fields_of_every_body(bench: ModuleType) -> None:
    for name, (kind, raw) in bench.bodies().items():
        model = parse_for(kind, orjson.loads(raw))
        for way, work in bench.paths(kind).items():
            taken = work(raw)
            if way == "msgspec decode":
                taken = taken[0]
            if way == "orjson alone":
                assert taken == orjson.loads(raw), name
                continue
            got = {field: getattr(taken, field) for field in FIELDS}
            assert got == {field: getattr(model, field) for field in FIELDS}, (name, way)


@pytest.mark.parametrize(
    "change",
    [
        {"n": 17},
        {"max_tokens": 0},
        {"cache_hit_threshold": 1.5},
        {"cache_hit_admission_only": "maybe"},
        {"prompt": 3},
        {"model": None},
    ],
)
def test_the_structs_reject_what_the_models_reject(
    bench: ModuleType, change: dict[str, Any]
) -> None:
    body = {"model": "m", "prompt": "hi", "max_tokens": 4, **change}
    with pytest.raises(RequestError):
        parse_for("completion", body)
    with pytest.raises((msgspec.ValidationError, ValueError)):
        msgspec.convert(body, bench._Completion)
