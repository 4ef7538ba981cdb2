"""The simulator's logprobs (pure): what a greedy model reports for its tokens.

The sampled token is always the most likely one (the simulator is greedy), its
logprob a function of the token and the one before it, so a continuation that
resumes after ``k`` tokens reports the same figures for what follows. Its ``top``
alternatives are words drawn from the same hash, each less likely than the last.
Completions get vLLM's ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``
(offsets counted by each token's string from ``offset``); chat gets the same figures
as ``content`` entries (:func:`~pd_orchestrator.flows.logprobs.chat_content`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pd_orchestrator.flows.logprobs import chat_content
from pd_orchestrator.openai.responses import Kind
from pd_orchestrator.sim.generation import advance
from pd_orchestrator.sim.tokenizer import NUM_WORDS, WORD_BASE, SimTokenizer

__all__ = ["asked_top", "logprobs_of"]

Json = dict[str, Any]


def asked_top(kind: Kind, extra: Json) -> int | None:
    """Alternatives per token a request asks (None: no logprobs): completions'
    ``logprobs``, chat's ``top_logprobs`` (0 when unset) when ``logprobs`` is true."""
    if kind == "completion":
        value = extra.get("logprobs")
        return value if isinstance(value, int) and not isinstance(value, bool) else None
    if extra.get("logprobs") is not True:
        return None
    top = extra.get("top_logprobs")
    return top if isinstance(top, int) and not isinstance(top, bool) else 0


def _figures(previous: int, token: int, top: int) -> tuple[float, list[tuple[int, float]]]:
    draw = advance(previous, token)
    value = -round((draw % 1000) / 4000, 4)
    alternatives = [(token, value)]
    for rank in range(1, top):
        draw = advance(draw, rank)
        other = WORD_BASE + draw % NUM_WORDS
        if other != token:
            alternatives.append((other, round(value - rank * 0.75, 4)))
    return value, alternatives


def logprobs_of(
    tokenizer: SimTokenizer,
    kind: Kind,
    ids: Sequence[int],
    previous: int,
    top: int,
    offset: int = 0,
) -> Json | list[Json] | None:
    """The logprobs of ``ids`` (``previous``: the token before the first) in ``kind``'s
    shape: completions' dict (offsets from ``offset``), chat's ``content`` list."""
    tokens: list[str] = []
    values: list[float] = []
    tops: list[dict[str, float]] = []
    offsets: list[int] = []
    for token in ids:
        value, alternatives = _figures(previous, token, max(top, 1))
        text = tokenizer.token_text(token)
        tokens.append(text)
        values.append(value)
        tops.append({tokenizer.token_text(t): lp for t, lp in alternatives[: max(top, 1)]})
        offsets.append(offset)
        offset += len(text)
        previous = token
    completions = {"text_offset": offsets, "token_logprobs": values, "tokens": tokens,
                   "top_logprobs": tops}  # fmt: skip
    if kind == "completion":
        return completions
    return chat_content(completions, top)
