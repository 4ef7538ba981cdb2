"""The connector protocol and the helpers every adapter shares."""

from __future__ import annotations

import copy
import enum
from dataclasses import dataclass
from typing import Any, Protocol

__all__ = [
    "Connector",
    "LegOrder",
    "PrefillOutcome",
    "UnknownConnectorError",
    "one_token_body",
]

Body = dict[str, Any]


class LegOrder(enum.Enum):
    """Whether the decode leg waits for the prefill answer or runs beside it."""

    SEQUENTIAL = "sequential"
    PARALLEL = "parallel"


class UnknownConnectorError(KeyError):
    """No adapter is registered under the requested name."""


@dataclass(frozen=True, slots=True)
class PrefillOutcome:
    """What a prefill answer means for the decode leg.

    ``params`` are the ``kv_transfer_params`` to hand to the decoder (None when the
    connector returns none: the decoder then loads what it can on its own, or
    recomputes). ``finished`` is true when the prefill answer is itself the whole
    answer (its first token ended the sequence).
    """

    params: dict[str, Any] | None
    finished: bool


class Connector(Protocol):
    """A KV-connector adapter. Every method is pure and never mutates its input."""

    name: str
    leg_order: LegOrder

    def prefill_body(self, body: Body) -> Body:
        """The body to send to the prefiller for a client body ``body``."""
        ...

    def read_prefill(self, answer: Body) -> PrefillOutcome:
        """Interpret the prefiller's (non-streamed) answer."""
        ...

    def decode_body(self, body: Body, params: dict[str, Any] | None) -> Body:
        """The body to send to the decoder, given the prefill's transfer params."""
        ...


def one_token_body(body: Body) -> Body:
    """A deep copy of ``body`` turned into a one-token, non-streamed request.

    ``max_tokens`` (and ``max_completion_tokens`` if present) become 1,
    ``stream_options`` goes, ``min_tokens`` is capped at 1 and the cache-hit
    threshold is dropped (prefill requests ignore it anyway).
    """
    out = copy.deepcopy(body)
    out["stream"] = False
    out.pop("stream_options", None)
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    if "min_tokens" in out:
        out["min_tokens"] = min(1, int(out["min_tokens"] or 0))
    out.pop("cache_hit_threshold", None)
    return out


def finished_naturally(answer: Body) -> bool:
    """Whether a one-token answer ended the sequence (stop, not length)."""
    choices = answer.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return False
    return choices[0].get("finish_reason") == "stop"
