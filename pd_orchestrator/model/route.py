"""What a threshold policy answers for one request: a :data:`Route`.

The decoder a request is asked on admits it iff its prefix-cache hit ratio (cached
tokens / prompt tokens) is at least the threshold sent with it. A policy answers one
of five routes, each with the policy (instance name) that chose it and a short,
stable ``reason`` usable as a metric label (``fixed``, ``decoder-busy``...):

- :class:`Ask`: ask the decoder at a threshold strictly between 0 and 1;
- :class:`Local`: prefill on the decoder (threshold 0: every decoder admits);
- :class:`GoPD`: P/D at once, no decode attempt (threshold 1: no decoder admits),
  the decode leg on ``peer`` when one is named (a ranked decoder the same
  prefillers reach), else on the chosen decoder;

  an :class:`Ask` or a :class:`GoPD` may name the ``prefiller`` its P/D leg goes to
  first (the one the policy's estimate assumed), else the prefill ranking's first;
- :class:`Whole`: serve the request whole, prefill and decode, on ``prefiller``, a
  prefiller whose pool spills (threshold 0 there);
- :class:`Decline`: the spilling prefiller the routing picked does not take the
  request: the planner ranks the decoders alone and asks again.

:func:`at` turns a threshold in [0, 1] into :class:`Local`, :class:`Ask` or
:class:`GoPD`. :func:`threshold_of` is the threshold each route sends (the one
composites order and average by). ``admission_only``: the endpoint asked
applies the threshold at admission only and never hands the request
back (set by the planner for requests a continuation cannot honour).
"""

from __future__ import annotations

from typing import assert_never

from pd_orchestrator.model.records import record

__all__ = ["Ask", "Decline", "GoPD", "Local", "Route", "Whole", "at", "threshold_of"]


@record
class Ask:
    """Ask the decoder at ``threshold`` (0 < threshold < 1)."""

    threshold: float
    policy: str
    reason: str
    admission_only: bool = False
    prefiller: str | None = None

    def __post_init__(self) -> None:
        if not 0.0 < self.threshold < 1.0:
            raise ValueError(
                f"an asked threshold lies in (0, 1), got {self.threshold} ({self.policy})"
            )


@record
class Local:
    """Prefill on the decoder: ask it at threshold 0."""

    policy: str
    reason: str
    admission_only: bool = False


@record
class GoPD:
    """P/D at once; the decode leg on ``peer`` (None: the chosen decoder). In ask-all
    the decoders are still asked, at threshold 1."""

    policy: str
    reason: str
    peer: str | None = None
    admission_only: bool = False
    prefiller: str | None = None


@record
class Whole:
    """Serve the request whole on ``prefiller``, a prefiller whose pool spills."""

    policy: str
    reason: str
    prefiller: str
    admission_only: bool = False


@record
class Decline:
    """The spilling prefiller the routing picked does not take the request."""

    policy: str
    reason: str
    admission_only: bool = False


Route = Ask | Local | GoPD | Whole | Decline
"""What a policy answers for one request (see the module docstring)."""


def at(
    threshold: float, policy: str, reason: str, prefiller: str | None = None
) -> Ask | Local | GoPD:
    """The route that sends ``threshold`` (in [0, 1]): 0 is :class:`Local`, 1 is
    :class:`GoPD` on the chosen decoder, anything between :class:`Ask` (either with
    ``prefiller`` first for its P/D leg)."""
    if not 0.0 <= threshold <= 1.0:
        raise ValueError(f"threshold {threshold} is outside [0, 1] ({policy})")
    if threshold == 0.0:
        return Local(policy, reason)
    if threshold == 1.0:
        return GoPD(policy, reason, prefiller=prefiller)
    return Ask(threshold, policy, reason, prefiller=prefiller)


def threshold_of(route: Route) -> float:
    """The threshold ``route`` sends: 0 for :class:`Local` and :class:`Whole` (the
    endpoint admits it), 1 for :class:`GoPD` and :class:`Decline` (none admits)."""
    match route:
        case Ask(threshold=threshold):
            return threshold
        case Local() | Whole():
            return 0.0
        case GoPD() | Decline():
            return 1.0
        case _:
            assert_never(route)
