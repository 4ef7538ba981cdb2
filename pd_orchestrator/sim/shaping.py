"""What constrains a request's output and how a chat answer under a tool choice reads.

:func:`constraint_of` reads the request fields vLLM 0.32/0.33 honours into a
:class:`~pd_orchestrator.sim.constrained.Constraint` (:class:`ShapeError`, the server's
400, for what is malformed or what the simulator does not generate): a chat request's
``tool_choice`` (named, ``required``, ``auto``, the default when ``tools`` is set;
``none`` or no tools: none), else ``structured_outputs`` (``json``, ``regex``,
``choice``, ``json_object``; ``grammar`` and ``structural_tag`` are refused), else
``response_format`` (``json_object``, ``json_schema``; ``text``: none).

:class:`CallShaper` turns the generated text of a chat answer into vLLM's shapes:
a named tool's text is the arguments of one call (``content`` empty, the finish the
engine's); ``required`` and an ``auto`` answer that calls tools generate
``[{"name": ..., "parameters": {...}}, ...]`` and answer one call per element (the
finish ``tool_calls``; whole, each call's arguments re-dumped as vLLM parses and
dumps them, ``", "`` and ``": "`` separators). Streamed, each call's first delta
carries its id, type and name, later ones only more ``arguments`` (the generated
text); a call keeps one id.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from pd_orchestrator.openai.protocol import ChatCompletionRequest, OpenAIRequest
from pd_orchestrator.sim.constrained import Constraint, Tool, UnsupportedConstraint

__all__ = ["CallShaper", "ShapeError", "constraint_of"]

Json = dict[str, Any]
_EMPTY_PARAMETERS: Json = {"type": "object", "properties": {}}


class ShapeError(ValueError):
    """A constraint field that is malformed or unsupported; ``param`` names it."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def constraint_of(request: OpenAIRequest) -> Constraint | None:
    """The constraint ``request`` asks for (None: free text); :class:`ShapeError`."""
    extra = request.model_extra or {}
    try:
        if isinstance(request, ChatCompletionRequest):
            tools = _tool_constraint(request, extra)
            if tools is not None:
                return tools
        if extra.get("structured_outputs") is not None:
            return _structured(extra["structured_outputs"])
        if extra.get("response_format") is not None:
            return _response_format(extra["response_format"])
    except UnsupportedConstraint as exc:
        raise ShapeError(str(exc), exc.param or _field(extra)) from None
    return None


def _field(extra: Json) -> str:
    for name in ("tool_choice", "structured_outputs", "response_format"):
        if extra.get(name) is not None:
            return name
    return "tools"


def _tools(raw: Any) -> tuple[Tool, ...]:
    if not isinstance(raw, list):
        raise ShapeError("tools: a list of tools is required", "tools")
    tools = []
    for entry in raw:
        function = entry.get("function") if isinstance(entry, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(function, dict) or not isinstance(name, str):
            raise ShapeError("tools: each tool needs a function with a name", "tools")
        tools.append(Tool(name, function.get("parameters") or _EMPTY_PARAMETERS))
    return tuple(tools)


def _tool_constraint(request: ChatCompletionRequest, extra: Json) -> Constraint | None:
    raw_tools = extra.get("tools")
    choice = extra.get("tool_choice", "auto" if raw_tools else None)
    if choice is None or choice == "none" or (choice == "auto" and not raw_tools):
        return None
    if not raw_tools:
        raise ShapeError("When using `tool_choice`, `tools` must be set.", "tool_choice")
    tools = _tools(raw_tools)
    parallel = extra.get("parallel_tool_calls") is not False
    if choice in ("required", "auto"):
        last = request.messages[-1].role
        return Constraint(
            "tools", tools=tools, mode=choice, parallel=parallel, text_after_tool=last == "tool"
        )
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise ShapeError(
            "tool_choice: 'none', 'auto', 'required' or a named function", "tool_choice"
        )
    for tool in tools:
        if tool.name == name:
            return Constraint("json", schema=tool.parameters, named=name)
    raise ShapeError(f"Tool '{name}' has not been passed in `tools`.", "tool_choice")


def _structured(raw: Any) -> Constraint:
    if not isinstance(raw, dict):
        raise ShapeError("structured_outputs: an object is required", "structured_outputs")
    for refused in ("grammar", "structural_tag"):
        if raw.get(refused) is not None:
            raise ShapeError(
                f"structured_outputs.{refused} is not supported by the simulator "
                "(json, regex, choice and json_object are)",
                "structured_outputs",
            )
    names = ("json", "regex", "choice", "json_object")
    kinds = [name for name in names if raw.get(name) not in (None, False)]
    if len(kinds) != 1:
        raise ShapeError(
            "structured_outputs: exactly one of json, regex, choice, json_object is required",
            "structured_outputs",
        )
    value = raw[kinds[0]]
    if kinds[0] == "json":
        return Constraint("json", schema=_schema(value, "structured_outputs"))
    if kinds[0] == "regex" and isinstance(value, str):
        return Constraint("regex", pattern=value)
    if kinds[0] == "choice" and isinstance(value, list) and value:
        if all(isinstance(c, str) for c in value):
            return Constraint("choice", choices=tuple(value))
    if kinds[0] == "json_object":
        return Constraint("json")
    raise ShapeError(f"structured_outputs.{kinds[0]} is malformed", "structured_outputs")


def _schema(value: Any, param: str) -> Any:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise ShapeError(f"{param}: the JSON schema is not valid JSON", param) from None
    if not isinstance(value, dict | bool):
        raise ShapeError(f"{param}: a JSON schema must be an object", param)
    return value


def _response_format(raw: Any) -> Constraint | None:
    kind = raw.get("type") if isinstance(raw, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json")
    if kind == "json_schema":
        spec = raw.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if schema is None:
            raise ShapeError("response_format.json_schema.schema is required", "response_format")
        return Constraint("json", schema=_schema(schema, "response_format"))
    if kind == "structural_tag":
        raise ShapeError(
            "response_format structural_tag is not supported by the simulator", "response_format"
        )
    raise ShapeError(
        "response_format.type must be text, json_object or json_schema", "response_format"
    )


# -- answers --------------------------------------------------------------------------
_CALL_HEAD = re.compile(r'\{"name":("(?:[^"\\]|\\.)*"),"parameters":')


def _value_end(text: str, start: int) -> int | None:
    """Index just past the JSON value that starts at ``start`` (None: not complete)."""
    depth = 0
    in_string = escaped = False
    for index in range(start, len(text)):
        char = text[index]
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "{[":
            depth += 1
        elif char in "}]":
            if depth == 0:
                return index
            depth -= 1
            if depth == 0:
                return index + 1
        elif char == "," and depth == 0:
            return index
    return None


def parse_calls(text: str) -> list[tuple[str, str]]:
    """The (name, arguments so far) of each call a required/auto answer's text (or its
    prefix) holds, in order."""
    calls: list[tuple[str, str]] = []
    position = 1
    while (head := _CALL_HEAD.match(text, position)) is not None:
        start = head.end()
        end = _value_end(text, start)
        calls.append((json.loads(head.group(1)), text[start : len(text) if end is None else end]))
        if end is None:
            break
        position = end + 2  # past the call's "}" and the ","
    return calls


def _redumped(arguments: str) -> str:
    """``arguments`` as vLLM writes a whole answer's parsed call (``json.dumps``), or as
    generated when they do not parse (cut short)."""
    try:
        return json.dumps(json.loads(arguments), ensure_ascii=False)
    except json.JSONDecodeError:
        return arguments


def _call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class CallShaper:
    """A chat answer under ``constraint`` (a tool choice, or None), whole or streamed."""

    constraint: Constraint | None
    _text: list[str] = field(default_factory=list)
    _sent: list[int] = field(default_factory=list)
    _ids: list[str] = field(default_factory=list)

    @property
    def named(self) -> str | None:
        """The function a named tool choice calls (its text is the arguments)."""
        return None if self.constraint is None else self.constraint.named

    @property
    def _calls_tools(self) -> bool:
        return self.constraint is not None and self.constraint.kind == "tools"

    def _calls(self, text: str) -> list[tuple[str, str]] | None:
        """The calls ``text`` makes (None: it is content)."""
        if self.named is not None:
            return [(self.named, text)]
        if self._calls_tools and text.startswith("["):
            return parse_calls(text)
        return None

    def text(self) -> str:
        """The text the streamed deltas carried so far."""
        return "".join(self._text)

    def finish(self, text: str, reason: str | None) -> str | None:
        """vLLM's finish reason: ``tool_calls`` for a required or auto call that ended."""
        if reason == "stop" and self.named is None and self._calls(text) is not None:
            return "tool_calls"
        return reason

    def message(self, text: str) -> Json:
        """A whole answer's message."""
        calls = self._calls(text)
        if calls is None:
            return {"role": "assistant", "content": text, "tool_calls": []}
        assert self.constraint is not None
        if self.named is None:  # vLLM parses the calls and dumps each one's arguments
            calls = [(name, _redumped(arguments)) for name, arguments in calls]
        tool_calls = [
            {"id": _call_id(), "type": "function", "function": {"name": n, "arguments": a}}
            for n, a in calls
        ]
        content = None if self.constraint.mode == "auto" and self.named is None else ""
        return {"role": "assistant", "content": content, "tool_calls": tool_calls}

    def delta(self, new_text: str) -> Json | None:
        """A streamed chunk's delta for ``new_text`` (None: plain content, as usual)."""
        self._text.append(new_text)
        text = "".join(self._text)
        calls = self._calls(text)
        if calls is None:
            return None
        deltas = []
        for index, (name, arguments) in enumerate(calls):
            if index == len(self._ids):
                self._ids.append(_call_id())
                self._sent.append(0)
                deltas.append({"id": self._ids[index], "type": "function", "index": index,
                               "function": {"name": name, "arguments": arguments}})  # fmt: skip
            elif len(arguments) > self._sent[index]:
                more = arguments[self._sent[index] :]
                deltas.append({"index": index, "function": {"arguments": more}})
            self._sent[index] = len(arguments)
        return {"tool_calls": deltas} if deltas else {}
