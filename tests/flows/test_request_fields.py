"""The fields a request sets, as continuations and token prompts read them: the quick
path for a body that sets none of them held to the field-by-field reading."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest

from pd_orchestrator.flows import request as request_module
from pd_orchestrator.flows.request import (
    CARRIED_FIELDS,
    UNCONTINUABLE_FIELDS,
    UNTOKENIZABLE_FIELDS,
    ClientRequest,
)
from pd_orchestrator.openai.protocol import parse_for

_NAMES = (UNCONTINUABLE_FIELDS, CARRIED_FIELDS, UNTOKENIZABLE_FIELDS,
          (*UNCONTINUABLE_FIELDS, *CARRIED_FIELDS))  # fmt: skip
_VALUES: tuple[Any, ...] = (
    None, False, True, 0, 1, 0.0, "", "none", "auto", [], {}, {"type": "text"},
    {"type": "json_object"}, [{"type": "function", "function": {"name": "f"}}],
    {"type": "function", "function": {"name": "f"}},
)  # fmt: skip
_OTHER = ("model", "prompt", "max_tokens", "stream", "temperature", "n", "seed")


def _reference(body: dict[str, Any], names: tuple[str, ...]) -> Iterator[str]:
    """The reading field by field, as it was before the quick path."""
    for name in names:
        if name in body and body[name] not in request_module._NEUTRAL.get(name, (None,)):
            if not (name == "response_format" and request_module._plain_text(body[name])):
                yield name


def _bodies(seed: int, count: int) -> Iterator[dict[str, Any]]:
    fields = sorted({*(n for names in _NAMES for n in names), *_OTHER})
    draw = random.Random(seed)
    for _ in range(count):
        chosen = draw.sample(fields, draw.randint(0, 6))
        yield {name: draw.choice(_VALUES) for name in chosen}


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_fields_set_are_those_read_one_by_one(seed: int) -> None:
    for body in _bodies(seed, 400):
        for names in _NAMES:
            assert request_module._sets(body, names) == tuple(_reference(body, names))


def test_a_plain_body_sets_none_and_a_neutral_value_is_no_setting() -> None:
    assert request_module._sets({"model": "m", "prompt": "p"}, UNCONTINUABLE_FIELDS) == ()
    neutral = {"tool_choice": "none", "prompt_logprobs": 0, "response_format": {"type": "text"}}
    assert request_module._sets(neutral, (*UNCONTINUABLE_FIELDS, *CARRIED_FIELDS)) == ()
    both = {"response_format": {"type": "json_object"}, "tools": [], "guided_json": {}}
    assert request_module._sets(both, (*UNCONTINUABLE_FIELDS, *CARRIED_FIELDS)) == (
        "tools", "guided_json", "response_format",
    )  # fmt: skip


@pytest.mark.parametrize("seed", [4, 5])
def test_a_requests_continuation_flags_follow_its_fields(seed: int) -> None:
    for body in _bodies(seed, 300):
        full = {"model": "m", "prompt": "hello", **{k: v for k, v in body.items()
                                                     if k not in _OTHER}}  # fmt: skip
        try:
            view = parse_for("completion", dict(full))
        except Exception:
            continue
        request = ClientRequest("completion", "/v1/completions", full, view, "r", 0.0)
        constraining = (*UNCONTINUABLE_FIELDS, *CARRIED_FIELDS)
        assert request.continuable == (not any(_reference(full, constraining)))
        first = next(iter(_reference(full, UNCONTINUABLE_FIELDS)), None)
        assert request.uncontinuable_field == first
        carried = any(_reference(full, CARRIED_FIELDS))
        assert request.resumable == (first is None and carried)
