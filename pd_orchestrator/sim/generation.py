"""Deterministic generation: the next token is a function of (seed, model, history).

The simulator keeps a 64-bit rolling state per request. ``initial_state(seed, model)``
starts it; ``advance(state, token)`` folds in one token. The next token depends only
on the state after the whole history (prompt and every generated token), so a request
resubmitted as ``prompt + first k outputs`` continues with exactly the tokens an
uninterrupted run produces -- the property the gateway's hand-back relies on.

EOS is drawn by the same rule: a state whose draw lands in the EOS slice ends the
sequence, unless EOS is suppressed (``ignore_eos``, or ``min_tokens`` not reached),
in which case the word drawn from the same state is used.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

from pd_orchestrator.sim.tokenizer import EOS_TOKEN_ID, NUM_WORDS, WORD_BASE

__all__ = ["EOS_ONE_IN", "advance", "advance_all", "initial_state", "next_token"]

_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
EOS_ONE_IN = 96
"""On average one state in ``EOS_ONE_IN`` ends the sequence."""


def _mix(value: int) -> int:
    """splitmix64 finaliser: a cheap, well-spread 64-bit permutation."""
    value = (value ^ (value >> 30)) * 0xBF58476D1CE4E5B9 & _MASK
    value = (value ^ (value >> 27)) * 0x94D049BB133111EB & _MASK
    return value ^ (value >> 31)


def initial_state(seed: int, model: str) -> int:
    """State before any token, for a server seed and a model name."""
    digest = hashlib.blake2b(f"{seed}\x00{model}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def advance(state: int, token: int) -> int:
    """Fold ``token`` into ``state``."""
    return _mix((state + _GOLDEN + token) & _MASK)


def advance_all(state: int, tokens: Iterable[int]) -> int:
    """Fold every token of ``tokens`` into ``state``, in order."""
    for token in tokens:
        state = _mix((state + _GOLDEN + token) & _MASK)
    return state


def next_token(state: int, *, allow_eos: bool) -> int:
    """The token that follows the history summarised by ``state``."""
    draw = _mix(state ^ 0xD1B54A32D192ED03)
    if allow_eos and draw % EOS_ONE_IN == 0:
        return EOS_TOKEN_ID
    return WORD_BASE + (draw >> 16) % NUM_WORDS
