"""Constrained generation: the documents a structured output or a tool choice makes (pure).

A :class:`Constraint` turns a seed into the text a constrained model answers, then into
the simulator's tokens (:meth:`Constraint.tokens`): a JSON document valid against a
schema (``response_format`` json_schema / json_object, ``structured_outputs.json``, a
named tool's ``parameters``), a string matching a regular expression
(``structured_outputs.regex``), one of ``structured_outputs.choice``, or the calls of a
``required`` / ``auto`` tool choice (``[{"name": ..., "parameters": {...}}, ...]``, the
form vLLM constrains a required choice to; ``auto`` is a seeded choice between calls
and free text, :meth:`Constraint.tokens` then answers None).

The document is a pure function of the seed: the engine seeds it with its generation
state after the prompt that precedes the output, so a request continued after ``k``
tokens (a hand-back's ``cache_hit_resume_tokens``) regenerates the same document and
carries on at token ``k``, as vLLM's grammar advanced over the ``k`` tokens would. JSON
is compact and ASCII (``\\u`` escapes of four hex digits), so every token decodes on
its own and the text re-tokenizes to the same tokens. What the generator cannot honour is refused
with :class:`UnsupportedConstraint` naming it (the server's 400).
"""

from __future__ import annotations

import json
import random
import re
import string
from collections.abc import Callable, Mapping, Sequence
from re import _parser as sre  # type: ignore[attr-defined]
from typing import Any, Literal

from pd_orchestrator.model.records import record
from pd_orchestrator.sim.tokenizer import SimTokenizer, word_for_id

__all__ = [
    "Constraint",
    "Tool",
    "UnsupportedConstraint",
    "check_schema",
    "regex_text",
    "schema_value",
]

Json = Any
ToolMode = Literal["named", "required", "auto"]
_TOKENIZER = SimTokenizer()
_WORDS = 400
"""Pseudo-words free strings and object keys are drawn from (the vocabulary's first)."""
_UNSUPPORTED_KEYWORDS = (
    "not",
    "if",
    "then",
    "else",
    "patternProperties",
    "dependentRequired",
    "dependentSchemas",
    "propertyNames",
    "contains",
    "unevaluatedProperties",
    "unevaluatedItems",
)
_MAX_DEPTH = 8
_REPEAT_SPAN = 3
"""A regex repeat without a bound repeats at most this many times beyond its minimum."""


class UnsupportedConstraint(ValueError):
    """A constraint the simulator cannot generate for; ``param`` names the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@record
class Tool:
    """A function the request offers: its name and its arguments' JSON schema."""

    name: str
    parameters: Json


@record
class Constraint:
    """What shapes an answer: ``kind`` json (``schema``; None: any JSON object), regex
    (``pattern``), choice (``choices``) or tools (``tools`` under ``mode``;
    ``parallel``: a required or auto choice may call more than one)."""

    kind: Literal["json", "regex", "choice", "tools"]
    schema: Json = None
    pattern: str = ""
    choices: tuple[str, ...] = ()
    tools: tuple[Tool, ...] = ()
    mode: ToolMode = "named"
    parallel: bool = True
    text_after_tool: bool = False
    """``auto``: the conversation ends with a tool's result (a model then mostly answers)."""
    named: str | None = None
    """The function a named tool choice calls (the document is its arguments; the same
    document as ``structured_outputs.json`` of its parameters)."""

    def __post_init__(self) -> None:
        """Refuse (:class:`UnsupportedConstraint`) what cannot be generated, up front."""
        rng = random.Random(0)
        if self.kind == "regex":
            regex_text(self.pattern, rng)
        elif self.kind == "json" and self.schema is not None:
            check_schema(self.schema)
            schema_value(self.schema, rng)
        elif self.kind == "tools":
            for tool in self.tools:
                check_schema(tool.parameters)
                schema_value(tool.parameters, rng)

    def text(self, seed: int) -> str | None:
        """The answer's text for ``seed`` (None: an ``auto`` choice that answers freely)."""
        rng = random.Random(seed)
        if self.kind == "json":
            value = schema_value(self.schema, rng) if self.schema is not None else _any_object(rng)
            return _dumps(value)
        if self.kind == "regex":
            return regex_text(self.pattern, rng)
        if self.kind == "choice":
            return rng.choice(self.choices)
        return self._calls(rng)

    def tokens(self, seed: int) -> tuple[int, ...] | None:
        """:meth:`text` as the simulator's tokens."""
        text = self.text(seed)
        return None if text is None else tuple(_TOKENIZER.encode(text))

    def _calls(self, rng: random.Random) -> str | None:
        if self.mode == "auto":
            odds = 0.25 if self.text_after_tool else 0.75
            if rng.random() >= odds:
                return None
        count = 2 if self.parallel and len(self.tools) > 1 and rng.random() < 0.25 else 1
        calls = []
        for _ in range(count):
            tool = rng.choice(self.tools)
            calls.append({"name": tool.name, "parameters": schema_value(tool.parameters, rng)})
        return _dumps(calls)


def _dumps(value: Json) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=True)


def _word(rng: random.Random) -> str:
    return word_for_id(256 + 1 + rng.randrange(_WORDS)).strip()


def _words(rng: random.Random, count: int) -> str:
    return " ".join(_word(rng) for _ in range(count))


def _any_object(rng: random.Random) -> dict[str, Json]:
    """A small JSON object (``json_object``): words as keys, simple values."""
    kinds: list[Callable[[], Json]] = [
        lambda: _words(rng, rng.randint(1, 3)),
        lambda: rng.randint(0, 100),
        lambda: rng.random() < 0.5,
    ]
    return {_word(rng): rng.choice(kinds)() for _ in range(rng.randint(1, 3))}


# -- JSON schema ------------------------------------------------------------------------
_SUBSCHEMA = ("items", "additionalProperties", "not")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")


def check_schema(schema: Json, root: Json = None, depth: int = 0) -> None:
    """Refuse (:class:`UnsupportedConstraint`) a schema with a keyword the generator
    does not honour anywhere in it, or a ``$ref`` it cannot resolve."""
    root = schema if root is None else root
    if isinstance(schema, bool):
        return
    if not isinstance(schema, Mapping):
        raise UnsupportedConstraint(f"a JSON schema must be an object, not {schema!r}")
    if depth > _MAX_DEPTH:
        return  # a recursive $ref: generation refuses it if it recurses that deep
    for keyword in _UNSUPPORTED_KEYWORDS:
        if keyword in schema:
            raise UnsupportedConstraint(
                f"the simulator does not support the JSON schema keyword {keyword!r}"
            )
    children: list[Json] = [schema[k] for k in _SUBSCHEMA if k in schema]
    for key in _SUBSCHEMA_LISTS:
        children += list(schema.get(key) or ())
    children += list((schema.get("properties") or {}).values())
    if "$ref" in schema:
        children.append(_resolve(schema["$ref"], root))
    for child in children:
        check_schema(child, root, depth + 1)


def schema_value(schema: Json, rng: random.Random, root: Json = None, depth: int = 0) -> Json:
    """A value valid against ``schema`` (a JSON schema), drawn from ``rng``;
    :class:`UnsupportedConstraint` for keywords the generator does not honour."""
    root = schema if root is None else root
    if schema is True or schema == {}:
        return _words(rng, 1)
    if not isinstance(schema, Mapping):
        raise UnsupportedConstraint(f"a JSON schema must be an object, not {schema!r}")
    if depth > _MAX_DEPTH:
        raise UnsupportedConstraint("the JSON schema nests too deeply (recursive $ref?)")
    for keyword in _UNSUPPORTED_KEYWORDS:
        if keyword in schema:
            raise UnsupportedConstraint(
                f"the simulator does not support the JSON schema keyword {keyword!r}"
            )
    if "$ref" in schema:
        return schema_value(_resolve(schema["$ref"], root), rng, root, depth + 1)
    if "const" in schema:
        return schema["const"]
    if "enum" in schema:
        return rng.choice(list(schema["enum"]))
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return schema_value(schema[key][0], rng, root, depth + 1)
    if "allOf" in schema:
        parts = schema["allOf"]
        if len(parts) != 1:
            raise UnsupportedConstraint("the simulator supports allOf with one schema only")
        return schema_value(parts[0], rng, root, depth + 1)
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = rng.choice(kind) if kind else None
    if kind is None:
        kind = _implied_type(schema)
    generate = _GENERATORS.get(kind)
    if generate is None:
        raise UnsupportedConstraint(f"the simulator does not support the JSON schema type {kind!r}")
    return generate(schema, rng, root, depth)


def _implied_type(schema: Mapping[str, Json]) -> str:
    if "properties" in schema or "required" in schema:
        return "object"
    if "items" in schema or "prefixItems" in schema:
        return "array"
    return "string"


def _resolve(ref: Json, root: Json) -> Json:
    if not isinstance(ref, str) or not ref.startswith("#"):
        raise UnsupportedConstraint(f"the simulator resolves local $ref only, not {ref!r}")
    node = root
    for part in ref.lstrip("#").strip("/").split("/") if ref != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(node, Mapping) or part not in node:
            raise UnsupportedConstraint(f"$ref {ref!r} names nothing in the schema")
        node = node[part]
    return node


def _object(schema: Mapping[str, Json], rng: random.Random, root: Json, depth: int) -> Json:
    properties = schema.get("properties") or {}
    required = set(schema.get("required") or ())
    out: dict[str, Json] = {}
    for name, sub in properties.items():
        if name in required or rng.random() < 0.5:
            out[name] = schema_value(sub, rng, root, depth + 1)
    extra = schema.get("additionalProperties", True)
    for name in sorted(required - set(properties)):
        out[name] = schema_value(True if isinstance(extra, bool) else extra, rng, root, depth + 1)
    if "properties" not in schema and extra is not False and not out:
        return _any_object(rng)
    return out


def _array(schema: Mapping[str, Json], rng: random.Random, root: Json, depth: int) -> Json:
    prefix = list(schema.get("prefixItems") or ())
    low = int(schema.get("minItems", max(1, len(prefix))))
    high = int(schema.get("maxItems", max(low, len(prefix), 1) + 2))
    length = rng.randint(low, max(low, high))
    if schema.get("items") is False:
        length = min(length, len(prefix))
    items: list[Json] = [schema_value(s, rng, root, depth + 1) for s in prefix[:length]]
    unique = bool(schema.get("uniqueItems"))
    attempts = 0
    while len(items) < length and attempts < 8 * length + 8:
        attempts += 1
        value = schema_value(schema.get("items", {"type": "integer"}), rng, root, depth + 1)
        if not unique or value not in items:
            items.append(value)
    return items


def _string(schema: Mapping[str, Json], rng: random.Random, root: Json, depth: int) -> Json:
    pattern = schema.get("pattern")
    fmt = schema.get("format")
    if isinstance(pattern, str):
        text = regex_text(pattern, rng)
    elif fmt in _FORMATS:
        text = _FORMATS[fmt](rng)
    else:
        text = _words(rng, rng.randint(1, 3))
    low, high = int(schema.get("minLength", 0)), schema.get("maxLength")
    if high is not None:
        text = text[: int(high)]
    return text + "a" * max(0, low - len(text))


def _bounds(schema: Mapping[str, Json], step: float) -> tuple[float, float]:
    low = schema.get("minimum")
    high = schema.get("maximum")
    if "exclusiveMinimum" in schema and not isinstance(schema["exclusiveMinimum"], bool):
        low = schema["exclusiveMinimum"] + step
    if "exclusiveMaximum" in schema and not isinstance(schema["exclusiveMaximum"], bool):
        high = schema["exclusiveMaximum"] - step
    if low is None:
        low = 0 if high is None else high - 100
    if high is None:
        high = low + 100
    return float(low), float(high)


def _integer(schema: Mapping[str, Json], rng: random.Random, root: Json, depth: int) -> Json:
    low, high = _bounds(schema, 1)
    first, last = -int(-low // 1), int(high // 1)
    multiple = schema.get("multipleOf")
    if isinstance(multiple, int) and multiple > 0:
        return multiple * rng.randint(-(-first // multiple), last // multiple)
    return rng.randint(first, max(first, last))


def _number(schema: Mapping[str, Json], rng: random.Random, root: Json, depth: int) -> Json:
    if "multipleOf" in schema:
        return _integer(schema, rng, root, depth)
    low, high = _bounds(schema, 0)
    value = low + (high - low) * rng.choice((0.25, 0.5, 0.75)) if high > low else low
    return int(value) if value.is_integer() else value


_GENERATORS: dict[Any, Callable[[Mapping[str, Json], random.Random, Json, int], Json]] = {
    "object": _object,
    "array": _array,
    "string": _string,
    "integer": _integer,
    "number": _number,
    "boolean": lambda schema, rng, root, depth: rng.random() < 0.5,
    "null": lambda schema, rng, root, depth: None,
}
_FORMATS: dict[str, Callable[[random.Random], str]] = {
    "date": lambda rng: f"2026-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}",
    "date-time": lambda rng: f"2026-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}T12:00:00Z",
    "time": lambda rng: f"{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}:00Z",
    "email": lambda rng: f"{_word(rng)}@example.com",
    "uri": lambda rng: f"https://example.com/{_word(rng)}",
    "uuid": lambda rng: f"{rng.getrandbits(32):08x}-0000-4000-8000-{rng.getrandbits(48):012x}",
}


# -- regular expressions ----------------------------------------------------------------
_PRINTABLE = string.ascii_letters + string.digits + "_-. "
_CATEGORIES: dict[Any, str] = {
    sre.CATEGORY_DIGIT: string.digits,
    sre.CATEGORY_NOT_DIGIT: string.ascii_letters + "_-",
    sre.CATEGORY_WORD: string.ascii_letters + string.digits + "_",
    sre.CATEGORY_NOT_WORD: "-. ",
    sre.CATEGORY_SPACE: " ",
    sre.CATEGORY_NOT_SPACE: string.ascii_letters + string.digits,
}


def regex_text(pattern: str, rng: random.Random) -> str:
    """A string that ``pattern`` matches whole (``re.fullmatch``), drawn from ``rng``;
    :class:`UnsupportedConstraint` for constructs the generator does not honour."""
    try:
        parsed = sre.parse(pattern)
    except re.error as exc:
        raise UnsupportedConstraint(f"invalid regex {pattern!r}: {exc}") from None
    groups: dict[int, str] = {}
    return _emit(list(parsed), rng, groups)


def _emit(items: Sequence[tuple[Any, Any]], rng: random.Random, groups: dict[int, str]) -> str:
    return "".join(_emit_one(op, arg, rng, groups) for op, arg in items)


def _emit_one(op: Any, arg: Any, rng: random.Random, groups: dict[int, str]) -> str:
    if op is sre.LITERAL:
        return chr(arg)
    if op is sre.NOT_LITERAL:
        return rng.choice([c for c in _PRINTABLE if ord(c) != arg])
    if op is sre.ANY:
        return rng.choice(string.ascii_letters)
    if op is sre.IN:
        return _from_set(arg, rng)
    if op is sre.AT:
        return ""
    if op is sre.BRANCH:
        return _emit(list(rng.choice(arg[1])), rng, groups)
    if op is sre.SUBPATTERN:
        text = _emit(list(arg[-1]), rng, groups)
        if arg[0] is not None:
            groups[arg[0]] = text
        return text
    if op in (sre.MAX_REPEAT, sre.MIN_REPEAT, getattr(sre, "POSSESSIVE_REPEAT", None)):
        low, high, body = arg
        high = low + _REPEAT_SPAN if high is sre.MAXREPEAT else min(high, low + _REPEAT_SPAN)
        return "".join(_emit(list(body), rng, groups) for _ in range(rng.randint(low, high)))
    if op is getattr(sre, "ATOMIC_GROUP", None):
        return _emit(list(arg), rng, groups)
    if op is sre.GROUPREF:
        return groups.get(arg, "")
    raise UnsupportedConstraint(f"the simulator does not support the regex construct {op}")


def _from_set(items: Sequence[tuple[Any, Any]], rng: random.Random) -> str:
    negate = bool(items) and items[0][0] is sre.NEGATE
    members: set[str] = set()
    for op, arg in items[1:] if negate else items:
        if op is sre.LITERAL:
            members.add(chr(arg))
        elif op is sre.RANGE:
            members.update(chr(c) for c in range(arg[0], min(arg[1], arg[0] + 255) + 1))
        elif op is sre.CATEGORY:
            members.update(_CATEGORIES.get(arg, ""))
        else:
            raise UnsupportedConstraint(f"the simulator does not support the regex set item {op}")
    pool = sorted(set(_PRINTABLE) - members) if negate else sorted(members)
    ascii_pool = [c for c in pool if c.isascii()] or pool
    if not ascii_pool:
        raise UnsupportedConstraint("a regex character set matches nothing the simulator writes")
    return rng.choice(ascii_pool)
