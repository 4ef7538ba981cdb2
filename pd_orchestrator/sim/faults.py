"""Protocol faults of a simulated instance: answers no vLLM would send (test hooks).

``--protocol-fault`` makes an instance misbehave in one way, on every answer it
generates, streamed or whole:

* ``tokens-after-finish``: a stream sends one more token after its finish reason;
* ``token-ids-type``: token ids are strings, not integers;
* ``choices-type``: ``choices`` is an object, not a list;
* ``finish-reason-type``: a finish reason is a number, not a string;
* ``choice-index``: the choice is numbered 7 (the request asked for one);
* ``long-line``: the answer's finishing chunk carries :data:`LONG_LINE` bytes of
  padding (one event longer than the gateway reads by default).

(``--always-reject`` is the other misbehaviour: ``cache_threshold`` whatever the
threshold, even 0.)
"""

from __future__ import annotations

from typing import Any, Literal, get_args

__all__ = ["LONG_LINE", "PROTOCOL_FAULTS", "ProtocolFault", "corrupt"]

ProtocolFault = Literal[
    "tokens-after-finish",
    "token-ids-type",
    "choices-type",
    "finish-reason-type",
    "choice-index",
    "long-line",
]
LONG_LINE = 17 << 20
"""Bytes of padding a ``long-line`` answer carries (the gateway's default limit is 16 MiB)."""
PROTOCOL_FAULTS: tuple[str, ...] = get_args(ProtocolFault)


def corrupt(answer: dict[str, Any], fault: ProtocolFault | None) -> dict[str, Any]:
    """``answer`` (a whole answer or a stream chunk, changed in place) as an instance
    with ``fault`` sends it; ``tokens-after-finish`` is the stream's own doing."""
    choices = answer.get("choices")
    if fault is None or not choices:
        return answer
    choice = choices[0]
    if fault == "token-ids-type" and isinstance(choice.get("token_ids"), list):
        choice["token_ids"] = [str(token) for token in choice["token_ids"]]
    elif fault == "choices-type":
        answer["choices"] = choice
    elif fault == "finish-reason-type" and choice.get("finish_reason") is not None:
        choice["finish_reason"] = 1
    elif fault == "choice-index":
        choice["index"] = 7
    elif fault == "long-line" and choice.get("finish_reason") is not None:
        choice["padding"] = " " * LONG_LINE
    return answer
