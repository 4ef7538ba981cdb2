"""Logprobs across legs, in the client's shape (pure).

A continuation is a completions request, so its legs return completions logprobs:
``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`` with, per step, a
dict of the top tokens (vLLM puts the sampled token's entry first and keeps
``k + 1`` entries). vLLM renders the same per-token figures for a chat client as
``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}`` with the
first ``k`` entries of that dict (``k`` = ``top_logprobs``, 0 when unset), bytes
the token's UTF-8. These functions turn one into the other, shift completions
offsets past the tokens the client already got (vLLM counts offsets by each token's
string, not by the answer's text), and merge a whole answer's pieces.

Contracts: inputs are never mutated; a value of the wrong shape (the upstream's
fault) is passed through as None rather than raised, since logprobs are reporting,
not tokens.
"""

from __future__ import annotations

from typing import Any

from pd_orchestrator.openai.responses import Kind

__all__ = [
    "LogprobsRecord",
    "chat_content",
    "continuation_logprobs",
    "for_client",
    "next_offset",
    "shifted",
]

Json = dict[str, Any]


def continuation_logprobs(body: Json, kind: Kind) -> int | None:
    """What a continuation (completions) asks as ``logprobs`` for a client body of
    ``kind``: the completions client's own value; a chat client's ``top_logprobs``
    (0 when unset) when it asked ``logprobs``; None when no logprobs were asked."""
    if kind == "completion":
        value = body.get("logprobs")
        return value if isinstance(value, int) and not isinstance(value, bool) else None
    if not body.get("logprobs"):
        return None
    top = body.get("top_logprobs")
    return top if isinstance(top, int) and not isinstance(top, bool) else 0


def _entry(token: str, logprob: Any) -> Json:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8", "replace"))}


def chat_content(logprobs: Any, top: int) -> list[Json] | None:
    """The chat ``content`` entries of completions ``logprobs``, ``top`` alternatives
    each (None: not completions logprobs)."""
    if not isinstance(logprobs, dict):
        return None
    tokens = logprobs.get("tokens")
    values = logprobs.get("token_logprobs")
    tops = logprobs.get("top_logprobs")
    if not isinstance(tokens, list) or not isinstance(values, list):
        return None
    content: list[Json] = []
    for i, token in enumerate(tokens):
        entry = _entry(str(token), values[i] if i < len(values) else None)
        step = tops[i] if isinstance(tops, list) and i < len(tops) else None
        alternatives = list(step.items())[:top] if isinstance(step, dict) else []
        entry["top_logprobs"] = [_entry(str(t), lp) for t, lp in alternatives]
        content.append(entry)
    return content


def shifted(logprobs: Any, offset: int) -> Any:
    """Completions ``logprobs`` with every ``text_offset`` moved by ``offset`` (the
    characters the client got before this leg); a copy, or the input when there is
    nothing to move."""
    if not offset or not isinstance(logprobs, dict):
        return logprobs
    offsets = logprobs.get("text_offset")
    if not isinstance(offsets, list):
        return logprobs
    moved = [o + offset if isinstance(o, int) else o for o in offsets]
    return {**logprobs, "text_offset": moved}


def next_offset(logprobs: Any, current: int) -> int:
    """The completions ``text_offset`` after ``logprobs`` (vLLM's rule: the last offset
    plus the length of its token's string), or ``current`` when they hold none."""
    if not isinstance(logprobs, dict):
        return current
    offsets, tokens = logprobs.get("text_offset"), logprobs.get("tokens")
    if not isinstance(offsets, list) or not isinstance(tokens, list) or not offsets or not tokens:
        return current
    last, token = offsets[-1], tokens[-1]
    return last + len(token) if isinstance(last, int) and isinstance(token, str) else current


def for_client(logprobs: Any, leg: Kind, client: Kind, top: int, offset: int) -> Any:
    """A leg's ``logprobs`` as the client's API shows them (see the module docstring)."""
    if logprobs is None or leg == client == "chat":
        return logprobs
    if client == "chat":
        content = chat_content(logprobs, top)
        return None if content is None else {"content": content}
    return shifted(logprobs, offset)


class LogprobsRecord:
    """A whole answer's logprobs, leg after leg, in the client's shape."""

    __slots__ = ("_completion", "_content", "client")

    def __init__(self, client: Kind) -> None:
        self.client = client
        self._content: list[Any] = []
        self._completion: dict[str, list[Any]] = {
            "text_offset": [],
            "token_logprobs": [],
            "tokens": [],
            "top_logprobs": [],
        }

    def add(self, shaped: Any) -> None:
        """Append one leg's logprobs, already in the client's shape (:func:`for_client`)."""
        if not isinstance(shaped, dict):
            return
        if self.client == "chat":
            content = shaped.get("content")
            if isinstance(content, list):
                self._content.extend(content)
            return
        for name, values in self._completion.items():
            piece = shaped.get(name)
            if isinstance(piece, list):
                values.extend(piece)

    def as_dict(self) -> Json:
        """The merged logprobs of the answer."""
        if self.client == "chat":
            return {"content": list(self._content)}
        return {name: list(values) for name, values in self._completion.items()}
