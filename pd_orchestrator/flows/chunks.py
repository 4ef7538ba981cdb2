"""Reading upstream answers and writing client answers (pure).

Upstream chunks are read into a :class:`ChunkView`, once each; a field read there
that has a type vLLM never sends (``choices`` not a list, token ids not integers, a
``finish_reason`` that is not a string, a choice ``index`` other than 0: every leg
asks for one choice, the gateway numbers the client's) raises :class:`MalformedChunk`,
which the legs turn into the endpoint's protocol error. A chunk whose leg speaks the
client's API is relayed as it came (every field vLLM sent survives: tool calls,
reasoning, logprobs), with the client's id and creation time, and with token ids
kept only when the client asked for them. A completions chunk that serves a chat
client (a request continued as a token prompt) is re-rendered as a chat chunk.
"""

from __future__ import annotations

from typing import Any, NamedTuple, TypeVar

from pd_orchestrator.model.records import record
from pd_orchestrator.openai.responses import Kind, stream_chunk

__all__ = [
    "CACHE_THRESHOLD",
    "ChunkView",
    "Identity",
    "MalformedChunk",
    "answer_as_chunks",
    "relay_chunk",
    "render_chunk",
    "view_answer",
    "view_chunk",
]

CACHE_THRESHOLD = "cache_threshold"
Json = dict[str, Any]


@record
class Identity:
    """The id, creation time and model the client sees on every chunk."""

    response_id: str
    created: int
    model: str


class ChunkView(NamedTuple):
    """What a chunk (or a whole answer) says, in API-independent terms.

    A named tuple: one is made per relayed chunk, and a tuple is the cheapest
    immutable record Python makes.
    """

    has_choice: bool
    text: str
    token_ids: tuple[int, ...] | None
    finish_reason: str | None
    prompt_token_ids: tuple[int, ...] | None
    usage: Json | None
    other_delta: bool = False
    logprobs: Any = None
    """The choice's logprobs as the upstream sent them (None: none)."""
    arguments: str = ""
    """A chat answer's first tool call's arguments (text a named tool choice produced)."""

    @property
    def decisive(self) -> bool:
        """Carries content or a finish: the moment a decoder's answer is known."""
        return self.has_choice and bool(
            self.text or self.token_ids or self.finish_reason or self.other_delta
        )

    @property
    def rejected(self) -> bool:
        return self.finish_reason == CACHE_THRESHOLD

    @property
    def completion_tokens(self) -> int | None:
        if self.usage is None:
            return None
        value = self.usage.get("completion_tokens")
        return value if isinstance(value, int) else None


class MalformedChunk(ValueError):
    """A chunk or answer with a field of a type vLLM never sends (the upstream's fault)."""


_INT = {int}
_KINDS: dict[type, str] = {str: "a string", dict: "an object", list: "a list"}
T = TypeVar("T")


def _ids(value: Any, name: str) -> tuple[int, ...] | None:
    """Token ids as an upstream sent them: a list of integers, or absent."""
    if value is None:
        return None
    if type(value) is not list:
        raise MalformedChunk(f"{name} is not a list")
    ids = tuple(value)
    if len(ids) > 8:  # a prompt's: one pass in C
        if set(map(type, ids)) != _INT:
            raise MalformedChunk(f"{name} holds something other than integers")
        return ids
    for token in ids:  # a chunk's one or few
        if type(token) is not int:
            raise MalformedChunk(f"{name} holds something other than integers")
    return ids


def _absent(value: Any, kind: type[T], name: str) -> None:
    """A field read as ``kind`` that is not one: absent (None) is fine, anything else
    is :class:`MalformedChunk` (called only off the hot path, when the type differs)."""
    if value is not None:
        raise MalformedChunk(f"{name} is not {_KINDS[kind]}")


def _first_choice(chunk: Json) -> Json | None:
    choices = chunk.get("choices")
    if type(choices) is not list:
        _absent(choices, list, "choices")
        return None
    if not choices:
        return None
    choice = choices[0]
    if type(choice) is not dict:
        raise MalformedChunk("a choice is not an object")
    index = choice.get("index", 0)
    if index != 0 or type(index) is not int or len(choices) > 1:
        raise MalformedChunk("a leg asks for one choice; the answer has another")
    return choice


def _usage(chunk: Json) -> Json | None:
    usage = chunk.get("usage")
    if usage is not None and type(usage) is not dict:
        _absent(usage, dict, "usage")
    return usage


def _text(value: Any, name: str) -> str:
    if type(value) is str:
        return value
    _absent(value, str, name)
    return ""


def _finish(choice: Json) -> str | None:
    reason = choice.get("finish_reason")
    if reason is not None and type(reason) is not str:
        _absent(reason, str, "finish_reason")
    return reason


_OTHER_DELTAS = ("tool_calls", "reasoning_content", "reasoning")


_view = tuple.__new__
"""Makes a :class:`ChunkView` from all its fields in order, without the named tuple's
keyword-taking ``__new__`` (a Python function): once per relayed chunk."""


def view_chunk(chunk: Json, kind: Kind) -> ChunkView:
    """Read one streamed chunk of an answer of ``kind``; :class:`MalformedChunk` when a
    field it reads has a type vLLM never sends (each is checked where it is read)."""
    choices = chunk.get("choices")
    # one choice numbered 0, as every leg asks, read inline (once per relayed chunk);
    # anything else is a usage chunk or a fault, which the usual reading names
    choice = choices[0] if type(choices) is list and len(choices) == 1 else None
    if type(choice) is not dict or (index := choice.get("index", 0)) != 0 or type(index) is not int:
        choice = _first_choice(chunk)
    usage = chunk.get("usage")
    if usage is not None and type(usage) is not dict:
        _absent(usage, dict, "usage")
    if choice is None:
        prompt = _ids(chunk.get("prompt_token_ids"), "prompt_token_ids")
        return ChunkView(False, "", None, None, prompt, usage)
    ids = choice.get("token_ids")
    token_ids: tuple[int, ...] | None
    if ids is None:
        token_ids = None
    elif type(ids) is list and len(ids) == 1 and type(ids[0]) is int:
        token_ids = (ids[0],)  # a decode step's one token: the common case, inline
    else:
        token_ids = _ids(ids, "token_ids")
    arguments = ""
    if kind == "completion":
        text = choice.get("text")
        raw_prompt = choice.get("prompt_token_ids")
        other = False
    else:
        delta = choice.get("delta")
        if type(delta) is not dict:
            _absent(delta, dict, "delta")
            delta = {}
        text = delta.get("content")
        raw_prompt = chunk.get("prompt_token_ids")
        # tool calls or reasoning make a chunk decisive (only asked when it has no text)
        other = not text and any(delta.get(k) for k in _OTHER_DELTAS)
        if other:
            arguments = _arguments(delta)
    if type(text) is not str:  # checked inline: this runs once per relayed chunk
        _absent(text, str, "text")
        text = ""
    finish = choice.get("finish_reason")
    if finish is not None and type(finish) is not str:
        _absent(finish, str, "finish_reason")
    prompt_ids = None if raw_prompt is None else _ids(raw_prompt, "prompt_token_ids")
    fields = (True, text, token_ids, finish, prompt_ids, usage, other,
              choice.get("logprobs"), arguments)  # fmt: skip
    return _view(ChunkView, fields)


def _arguments(message: Json) -> str:
    """The arguments text of a chat delta's or message's first tool call ("" if none)."""
    calls = message.get("tool_calls")
    call = calls[0] if type(calls) is list and calls else None
    function = call.get("function") if type(call) is dict else None
    arguments = function.get("arguments") if type(function) is dict else None
    return arguments if type(arguments) is str else ""


def view_answer(answer: Json, kind: Kind) -> ChunkView:
    """Read a whole (non-streamed) answer of ``kind`` (:class:`MalformedChunk` as for
    :func:`view_chunk`)."""
    choice = _first_choice(answer) or {}
    arguments = ""
    if kind == "completion":
        text = _text(choice.get("text"), "text")
        prompt_ids = _ids(choice.get("prompt_token_ids"), "prompt_token_ids")
    else:
        message = choice.get("message")
        if type(message) is not dict:
            _absent(message, dict, "message")
            message = {}
        text = _text(message.get("content"), "content")
        prompt_ids = _ids(answer.get("prompt_token_ids"), "prompt_token_ids")
        arguments = _arguments(message)
    return ChunkView(
        has_choice=bool(choice),
        text=text,
        token_ids=_ids(choice.get("token_ids"), "token_ids"),
        finish_reason=_finish(choice),
        prompt_token_ids=prompt_ids,
        usage=_usage(answer),
        logprobs=choice.get("logprobs"),
        arguments=arguments,
    )


def relay_chunk(
    chunk: Json, identity: Identity, *, keep_ids: bool, first: bool, index: int = 0
) -> Json:
    """A same-API chunk for the client: its identity, ids only if asked, no usage,
    the choice numbered ``index``. ``chunk`` is one :func:`view_chunk` read (its
    choices, if any, are one object).

    Takes ``chunk`` over (it is changed and returned: no copy on the relay path).
    """
    out = chunk
    out["id"] = identity.response_id
    out["created"] = identity.created
    out.pop("usage", None)
    out.pop("kv_transfer_params", None)
    if not keep_ids or not first:
        out.pop("prompt_token_ids", None)
    choices = out.get("choices")
    if choices:  # its one choice, an object (:func:`view_chunk` read it)
        choice = choices[0]
        if not keep_ids:
            choice.pop("token_ids", None)
        if not keep_ids or not first:
            choice.pop("prompt_token_ids", None)
        if index:
            choice["index"] = index
    return out


def render_chunk(
    view: ChunkView,
    identity: Identity,
    kind: Kind,
    *,
    keep_ids: bool,
    finish: str | None,
    index: int = 0,
    logprobs: Any = None,
) -> Json:
    """A client chunk of ``kind`` made from a chunk of another API (``logprobs``:
    already in the client's shape)."""
    chunk = stream_chunk(
        kind=kind,
        response_id=identity.response_id,
        model=identity.model,
        created=identity.created,
        text=view.text if view.text or kind == "completion" else None,
        finish_reason=finish,
        token_ids=list(view.token_ids or ()) if keep_ids else None,
    )
    if index:
        chunk["choices"][0]["index"] = index
    if logprobs is not None:
        chunk["choices"][0]["logprobs"] = logprobs
    return chunk


def answer_as_chunks(answer: Json, kind: Kind) -> list[Json]:
    """A whole answer of ``kind`` as the chunks a stream of it would carry."""
    view = view_answer(answer, kind)
    identity = Identity(
        str(answer.get("id") or ""), int(answer.get("created") or 0), str(answer.get("model") or "")
    )
    chunks: list[Json] = []
    prompt_ids = list(view.prompt_token_ids) if view.prompt_token_ids is not None else None
    if kind == "chat":
        role = stream_chunk(
            kind=kind,
            response_id=identity.response_id,
            model=identity.model,
            created=identity.created,
            text=None,
            role=True,
            prompt_token_ids=prompt_ids,
        )
        chunks.append(role)
        prompt_ids = None
    body = render_chunk(view, identity, kind, keep_ids=True, finish=view.finish_reason)
    if prompt_ids is not None:
        body["choices"][0]["prompt_token_ids"] = prompt_ids
    chunks.append(body)
    if view.usage is not None:
        chunks.append({**identity_fields(identity, kind), "choices": [], "usage": view.usage})
    return chunks


def identity_fields(identity: Identity, kind: Kind) -> Json:
    """The id/object/created/model fields of a chunk of ``kind``."""
    return {
        "id": identity.response_id,
        "object": "text_completion" if kind == "completion" else "chat.completion.chunk",
        "created": identity.created,
        "model": identity.model,
    }
