"""The constrained generator: every document validates, and a continuation from any
split point carries on with the same document (the engine's resume)."""

from __future__ import annotations

import json
import random
import re
from typing import Any

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pd_orchestrator.sim.constrained import (
    Constraint,
    Tool,
    UnsupportedConstraint,
    regex_text,
)
from pd_orchestrator.sim.engine import FinishReason
from pd_orchestrator.sim.shaping import CallShaper, parse_calls
from pd_orchestrator.sim.tokenizer import EOS_TOKEN_ID
from tests.sim.helpers import TOK, make_engine, request, run

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 2, "maxLength": 12},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "hourly": {"type": "boolean"},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
SCHEMAS: list[dict[str, Any]] = [
    WEATHER,
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
     "minItems": 20, "maxItems": 20},
    {"$defs": {"point": {"type": "object", "properties": {"x": {"type": "number"},
                                                          "y": {"type": "number"}},
                         "required": ["x", "y"]}},
     "type": "object", "properties": {"path": {"type": "array", "items": {"$ref": "#/$defs/point"},
                                               "minItems": 1, "maxItems": 4},
                                      "label": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                                      "id": {"type": "string", "format": "uuid"},
                                      "code": {"type": "string", "pattern": "^[A-Z]{3}-\\d{2}$"}},
     "required": ["path", "code"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                               "uniqueItems": True, "maxItems": 3},
                                      "score": {"type": "number", "exclusiveMinimum": 0,
                                                "exclusiveMaximum": 1}}},
]  # fmt: skip
PATTERNS = [r"\d{3}-[a-z]+", r"(cat|dog)s?!", r"[A-Z][a-z]{2,5}@x\.com", r"[^0-9]+", r"(ab)+\1"]


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(SCHEMAS), st.integers(0, 2**64 - 1))
def test_every_generated_document_validates_and_re_tokenizes_to_its_tokens(
    schema: dict[str, Any], seed: int
) -> None:
    constraint = Constraint("json", schema=schema)
    text = constraint.text(seed)
    assert text is not None
    jsonschema.validate(json.loads(text), schema, format_checker=jsonschema.FormatChecker())
    tokens = constraint.tokens(seed)
    assert tokens is not None and list(tokens) == TOK.encode(text)
    assert "".join(TOK.decode([t]) for t in tokens) == text  # streamed token by token


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(PATTERNS), st.integers(0, 2**64 - 1))
def test_every_regex_answer_matches_whole(pattern: str, seed: int) -> None:
    assert re.fullmatch(pattern, regex_text(pattern, random.Random(seed)))


def test_json_object_choice_and_the_same_seed_gives_the_same_document() -> None:
    anything = Constraint("json")
    assert isinstance(json.loads(anything.text(7) or ""), dict)
    assert anything.text(7) == anything.text(7) and anything.text(7) != anything.text(8)
    choice = Constraint("choice", choices=("red", "green"))
    assert {choice.text(seed) for seed in range(20)} == {"red", "green"}


@pytest.mark.parametrize(
    ("schema", "keyword"),
    [({"not": {"type": "string"}}, "not"), ({"if": {}, "then": {}}, "if"),
     ({"type": "object", "properties": {"a": {"$ref": "http://x/s.json"}}}, "local $ref")],
)  # fmt: skip
def test_unsupported_schemas_are_refused_naming_the_keyword(
    schema: dict[str, Any], keyword: str
) -> None:
    with pytest.raises(UnsupportedConstraint, match=re.escape(keyword)):
        Constraint("json", schema=schema)


def test_a_regex_construct_it_cannot_write_is_refused() -> None:
    with pytest.raises(UnsupportedConstraint, match="regex"):
        Constraint("regex", pattern=r"(?=a)b")


TOOLS = (Tool("get_weather", WEATHER), Tool("noop", {"type": "object", "properties": {}}))


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**64 - 1), st.sampled_from(["required", "auto"]))
def test_tool_calls_parse_into_valid_arguments(seed: int, mode: str) -> None:
    constraint = Constraint("tools", tools=TOOLS, mode=mode)  # type: ignore[arg-type]
    text = constraint.text(seed)
    if text is None:
        assert mode == "auto"
        return
    calls = parse_calls(text)
    assert len(calls) == len(json.loads(text)) >= 1
    schemas = {tool.name: tool.parameters for tool in TOOLS}
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), schemas[name])


def test_a_streamed_call_has_one_id_and_its_deltas_join_to_the_arguments() -> None:
    constraint = Constraint("tools", tools=TOOLS, mode="required")
    seed = next(s for s in range(100) if len(json.loads(constraint.text(s) or "[]")) == 2)
    tokens = constraint.tokens(seed) or ()
    shaper = CallShaper(constraint)
    deltas = [shaper.delta(TOK.decode([t])) for t in tokens]
    calls: dict[int, dict[str, Any]] = {}
    for delta in deltas:
        assert delta is not None
        for call in delta.get("tool_calls", []):
            entry = calls.setdefault(call["index"], {"ids": [], "arguments": ""})
            entry["ids"] += [call["id"]] if "id" in call else []
            entry["arguments"] += call["function"]["arguments"]
    whole = parse_calls(constraint.text(seed) or "")
    assert [c["arguments"] for c in calls.values()] == [a for _, a in whole]
    assert all(len(c["ids"]) == 1 for c in calls.values())
    assert shaper.finish(shaper.text(), "stop") == "tool_calls"


# -- in the engine ------------------------------------------------------------------------
def _constrained(rid: str, prompt: list[int], constraint: Constraint, resume: int = 0) -> Any:
    return request(rid, prompt, 400, constraint=constraint, resume_tokens=resume)


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(SCHEMAS), st.lists(st.integers(300, 3000), min_size=1, max_size=30),
       st.integers(0, 400))  # fmt: skip
def test_a_continuation_from_any_split_point_gives_the_same_document(
    schema: dict[str, Any], prompt: list[int], split: int
) -> None:
    constraint = Constraint("json", schema=schema)
    whole = run(make_engine(), [_constrained("a", prompt, constraint)])["a"]
    assert whole.finish_reason is FinishReason.STOP and whole.tokens[-1] == EOS_TOKEN_ID
    document = whole.tokens[:-1]
    jsonschema.validate(json.loads(TOK.decode(document)), schema)
    split = min(split, len(document))
    resumed = _constrained("b", prompt + document[:split], constraint, resume=split)
    rest = run(make_engine(), [resumed])["b"]
    assert document[:split] + rest.tokens[:-1] == document


def test_resumed_tokens_that_are_not_the_document_are_refused() -> None:
    constraint = Constraint("json", schema=WEATHER)
    with pytest.raises(ValueError, match="cache_hit_resume_tokens"):
        make_engine().add_request(_constrained("a", [400, 401, *TOK.encode("[1")], constraint, 2))
