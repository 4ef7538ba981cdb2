"""Reading upstream answers and writing client answers (pure).

Upstream chunks are read into a :class:`ChunkView`. A chunk whose leg speaks the
client's API is relayed as it came (every field vLLM sent survives: tool calls,
reasoning, logprobs), with the client's id and creation time, and with token ids
kept only when the client asked for them. A completions chunk that serves a chat
client (a request continued as a token prompt) is re-rendered as a chat chunk.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

from pd_orchestrator.openai.responses import Kind, stream_chunk

__all__ = [
    "CACHE_THRESHOLD",
    "ChunkView",
    "Identity",
    "answer_as_chunks",
    "relay_chunk",
    "render_chunk",
    "view_answer",
    "view_chunk",
]

CACHE_THRESHOLD = "cache_threshold"
Json = dict[str, Any]


@dataclass(frozen=True, slots=True)
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


def _ids(value: Any) -> tuple[int, ...] | None:
    """Token ids as an upstream sent them (a list, taken as vLLM's list of ints; a
    malformed upstream is caught when a continuation is sent, not on every chunk)."""
    return tuple(value) if type(value) is list else None


def _first_choice(chunk: Json) -> Json | None:
    choices = chunk.get("choices")
    if type(choices) is list and choices and type(choices[0]) is dict:
        return choices[0]
    return None


def _usage(chunk: Json) -> Json | None:
    usage = chunk.get("usage")
    return usage if type(usage) is dict else None


_OTHER_DELTAS = ("tool_calls", "reasoning_content", "reasoning")


def view_chunk(chunk: Json, kind: Kind) -> ChunkView:
    """Read one streamed chunk of an answer of ``kind``."""
    choice = _first_choice(chunk)
    usage = chunk.get("usage")
    if type(usage) is not dict:
        usage = None
    if choice is None:
        return ChunkView(False, "", None, None, _ids(chunk.get("prompt_token_ids")), usage)
    ids = choice.get("token_ids")
    token_ids = tuple(ids) if type(ids) is list else None
    if kind == "completion":
        text = choice.get("text") or ""
        raw_prompt = choice.get("prompt_token_ids")
        other = False
    else:
        delta = choice.get("delta")
        if type(delta) is not dict:
            delta = {}
        text = delta.get("content") or ""
        raw_prompt = chunk.get("prompt_token_ids")
        # tool calls or reasoning make a chunk decisive (only asked when it has no text)
        other = not text and any(delta.get(k) for k in _OTHER_DELTAS)
    prompt_ids = tuple(raw_prompt) if type(raw_prompt) is list else None
    if type(text) is not str:
        text = str(text)
    return ChunkView(True, text, token_ids, choice.get("finish_reason"), prompt_ids, usage, other)


def view_answer(answer: Json, kind: Kind) -> ChunkView:
    """Read a whole (non-streamed) answer of ``kind``."""
    choice = _first_choice(answer) or {}
    if kind == "completion":
        text = choice.get("text") or ""
        prompt_ids = _ids(choice.get("prompt_token_ids"))
    else:
        raw_message = choice.get("message")
        message: Json = raw_message if isinstance(raw_message, dict) else {}
        text = message.get("content") or ""
        prompt_ids = _ids(answer.get("prompt_token_ids"))
    return ChunkView(
        has_choice=bool(choice),
        text=str(text),
        token_ids=_ids(choice.get("token_ids")),
        finish_reason=choice.get("finish_reason"),
        prompt_token_ids=prompt_ids,
        usage=_usage(answer),
    )


def relay_chunk(
    chunk: Json, identity: Identity, *, keep_ids: bool, first: bool, index: int = 0
) -> Json:
    """A same-API chunk for the client: its identity, ids only if asked, no usage,
    the choice numbered ``index``.

    Takes ``chunk`` over (it is changed and returned: no copy on the relay path).
    """
    out = chunk
    out["id"] = identity.response_id
    out["created"] = identity.created
    out.pop("usage", None)
    out.pop("kv_transfer_params", None)
    if not keep_ids or not first:
        out.pop("prompt_token_ids", None)
    for choice in out.get("choices") or []:
        if not isinstance(choice, dict):
            continue
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
) -> Json:
    """A client chunk of ``kind`` made from a chunk of another API."""
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
