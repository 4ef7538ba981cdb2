"""Start-up calibration: the cold prompts a gateway times itself on a pool it knows
nothing of, before the first burst is planned on the seeds.

Without a profile, ``goodput`` prices every prefill at the ``prefill_tokens_per_s``
seed until requests end and teach it (the cached count a rate needs comes only with
a request's last usage). A cold burst is planned before any of its requests ends, so
all of it is planned on the seed: on the simulated H200 the seed (20,000 tokens/s)
read each decoder's wait 1.7 times too long, and a burst at x13 kept 140 of 400
prompts queued on their decoders against 66 with the profile. So the gateway first
times a few cold prompts of its own on one endpoint of each pool that has no profile
and has learnt no local rate (:func:`plan_probes`), as the profiler's first phase
does, and the policy learns them as samples (:meth:`GoodputModel.calibrate`):

* on a pool that decodes, the pool's local rate (and, with lengths far enough apart,
  the attention term of its prefills);
* on a dedicated prefill pool, its own local rate and the remote rate of each decoder
  pool of its group that has no profile (the prefill leg of a P/D request is the same
  computation, on the same engine).

* on a pool that decodes, more prompts of the shortest length, as many as it was
  timed for its rate and three at least, that generate ``probe_step_tokens`` tokens,
  streamed: the median of their mean gaps between tokens is the decode step of one
  stream, the step the pool prices until traffic teaches it against the batch
  (before, a cold burst with no profile priced every decode step as free: on the
  simulated mixed fleet every one of a burst's stall bounds read a step of 0 ms,
  where the profile's read 7.2 ms).

What it does not teach: the step's growth with the batch and the hand-over's costs,
which only traffic shows (a pool's first streams and P/D requests).

This module plans and records; the gateway (:mod:`pd_orchestrator.gateway.calibrate`)
and the virtual bench carry the probes out: each prompt after the one before has
been answered, one endpoint after another.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pd_orchestrator.model.endpoints import Endpoint
from pd_orchestrator.model.load import Candidate
from pd_orchestrator.model.records import record

__all__ = ["COLD_TOKEN_IDS", "STEP_REPEATS", "Probe", "Timed", "plan_probes"]

COLD_TOKEN_IDS = (100, 4000)
"""The range a cold prompt's token ids are drawn from, within any model's vocabulary
(the start-up timing's and the profiler's): fresh random ids share no block with
any other prompt."""


STEP_REPEATS = 3
"""The fewest decode step prompts a probe sends: their median stands clear of one the
host slows (:meth:`~pd_orchestrator.policies.goodput_model.GoodputModel.calibrate`)."""


@record
class Probe:
    """The cold prompts to time on ``endpoint``, one of each length of ``lengths``
    (tokens), one after another, none sent once ``seconds`` have passed since the
    first; ``decoders``: one endpoint of each decoder pool whose remote rate these
    prompts time (those of a dedicated prefiller's group); ``step_tokens``: after them,
    on an endpoint that decodes, cold prompts of the shortest length with that many
    output tokens, as many as ``lengths`` holds that length and
    :data:`STEP_REPEATS` at least, each streaming
    ``step_tokens - 1`` decode steps of one stream after its first token (0: none)."""

    endpoint: Endpoint
    lengths: tuple[int, ...]
    decoders: tuple[Endpoint, ...] = ()
    seconds: float = 30.0
    step_tokens: int = 0

    def prompts(self, longest: int | None = None) -> list[tuple[int, int]]:
        """The prompts to send, in order, as ``(length, output tokens)``: each of
        ``lengths`` for one token, then with ``step_tokens`` the shortest of them for
        that many, as often as ``lengths`` repeats it and :data:`STEP_REPEATS` times at
        least; only those that fit ``longest``, the most prompt tokens the model takes
        with one output token (None: all)."""

        def fits(length: int, output: int) -> bool:
            return longest is None or length + output - 1 <= longest

        prompts = [(length, 1) for length in self.lengths if fits(length, 1)]
        room = [length for length in self.lengths if fits(length, self.step_tokens)]
        if self.step_tokens > 1 and room:
            shortest = min(room)
            repeats = max(STEP_REPEATS, room.count(shortest))
            prompts += [(shortest, self.step_tokens)] * repeats
        return prompts


@record
class Timed:
    """One probe prompt as timed: ``tokens`` the prompt's tokens as the endpoint
    counted them, ``cached`` of those what it held (None: not reported, so not learnt
    as a local rate), ``seconds`` from its send to its answer (the two hops, the
    prefill and one step). ``queued`` and ``alone``: as
    :class:`~pd_orchestrator.policies.base.LatencyObservation` has them, when it was
    sent; ``output``: the tokens it generated (more than 1: the probe's decode step
    prompt, :attr:`Probe.step_tokens`, whose ``seconds`` also count those steps);
    ``gap``: for such a prompt streamed, the mean time between its tokens after the
    first (from the first token's arrival to the last's, over the tokens between),
    its decode step read apart from its prefill (None: not streamed)."""

    tokens: int
    cached: int | None
    seconds: float
    queued: bool | None = None
    alone: bool | None = None
    output: int = 1
    gap: float | None = None


def plan_probes(
    candidates: Sequence[Candidate],
    unknown: Callable[[Endpoint], bool],
    lengths: tuple[int, ...],
    seconds: float,
    step_tokens: int = 0,
) -> list[Probe]:
    """One :class:`Probe` per pool ``unknown`` says needs one (no profile, no local rate
    learnt), on its healthy endpoint with the fewest streams (ties: by name), of
    ``lengths`` within ``seconds``, and ``step_tokens`` where that endpoint decodes
    (or spills); none without ``lengths``. A dedicated prefill pool's probe names one
    endpoint of each decoder pool of its group that has no profile."""
    if not lengths:
        return []
    picks: dict[str, Candidate] = {}
    for candidate in sorted(candidates, key=lambda c: (c.streams, c.endpoint.name)):
        pool = candidate.endpoint.pool
        if candidate.healthy and pool not in picks and unknown(candidate.endpoint):
            picks[pool] = candidate
    ordered = sorted(picks.values(), key=lambda c: c.endpoint.name)
    return [_probe(c.endpoint, lengths, candidates, seconds, step_tokens) for c in ordered]


def _probe(
    endpoint: Endpoint,
    lengths: tuple[int, ...],
    candidates: Sequence[Candidate],
    seconds: float,
    step_tokens: int,
) -> Probe:
    """``endpoint``'s probe: its decode step only where it decodes or spills."""
    decodes = endpoint.role.decodes or endpoint.spill
    decoders = _decoders_of(endpoint, candidates)
    return Probe(endpoint, lengths, decoders, seconds, step_tokens if decodes else 0)


def _decoders_of(prefiller: Endpoint, candidates: Sequence[Candidate]) -> tuple[Endpoint, ...]:
    """One endpoint (the first by name) of each decoder pool of a dedicated
    ``prefiller``'s group whose endpoints carry no profile; none for an endpoint that
    decodes."""
    if prefiller.role.decodes:
        return ()
    first: dict[str, Endpoint] = {}
    for candidate in sorted(candidates, key=lambda c: c.endpoint.name):
        endpoint = candidate.endpoint
        same = endpoint.group == prefiller.group and endpoint.role.decodes
        if same and endpoint.knowledge is None and endpoint.pool not in first:
            first[endpoint.pool] = endpoint
    return tuple(first.values())
