"""The ``goodput`` cost model: what it knows, what it estimates, how it learns.

Notation, for the chosen decoder ``d`` and a prompt of ``L`` tokens: ``c`` the tokens
``d`` holds (the prefix index's count, else ``L * hit_d``) and ``u = L - c``; ``r_d``,
``r_p`` its pool's local and remote prefill rates (tokens/s); ``a`` the attention
term (s per token pair); ``H(L) = f + L * x`` the KV hand-over's cost (fixed and
per token); ``h`` one leg's one-way latency
(``hop``); ``T``, ``s`` the TTFT target and its ``slack``; ``m``, ``o`` the mean prompt
and output (learnt; before: this prompt, the ``out_mean`` seed); ``q`` the cached share
of a queue (a reading's hit rate, else this prompt's own cached share, else 0).

Estimates, in seconds (:class:`GoodputModel`)::

    prefill(r, n, k) = n / r + a * n * (k + n / 2)       n new tokens after k cached
    wait_d   = (backlog_d + min(waiting_d, n_d - f_d) * m) * (1 - q_d) / r_d
    local    = prefill(r_d, u, c)                          beyond wait_d
    remote   = min over p of  max(backlog_p, n_p * m) * (1 - hit_p) / r_p
                              + prefill(r_p, u_p, L - u_p)
               + H(L) + 3h                                 beyond wait_d
    whole_p  = (backlog_p + min(waiting_p, n_p - f_p) * m) / r_p + prefill(r_p, u_p, L - u_p)
    W = o * tpot,  share_d = kept_d / (W * r_d),  itl'_d = itl_d * exp(-age_d / W) (profile known)
    step_d   = max(itl'_d * (1 - share_d), profile)
             = max(itl_d, S(n_d)) * (1 - share_d)          (no profile)
    mean_d   = (1 - step_d / (tpot * tpot_goal) - share_d) * W * r_d
    short_d  = the u whose local prefill takes (tpot - step_d) * o_low
    stall_d  = max(free, min(mean_d, short_d))                                    tokens

``backlog_e``: the prompt tokens of the gateway's requests at an endpoint ``e`` that
have had no first token (exact); ``n_e``: requests at ``e`` (its reading's running and
waiting, or the gateway's count, the larger), ``f_e`` of them the gateway's (in
flight), ``waiting_e`` those its reading counts queued: at a decoder (and a spilling
prefiller served whole) the mean prompt stands in only for the queued requests the
gateway did not send, whose sizes it does not know; a remote path's prefiller counts
the larger of its backlog and all its requests at the mean (the sum overcounts where
a reading lags behind requests that have left);
``S(n)``: the ITL learnt against the streams ``n`` a batch holds, a line (fixed and
per stream, :mod:`~pd_orchestrator.policies.octave_line`) through the pool's ITL
samples, each at the streams its decoder ran when the request was planned, plus
itself (flat while the samples span one octave; before any, ``S`` is ``itl_d``);
``n_d``: the streams decoding at ``d``; ``age_d``: seconds since the pool's last ITL
sample (:meth:`GoodputModel.recent_itl`: a sample times streams that have finished
a window or so later; it ages towards the step the pool otherwise knows, the
profile's, or without one ``S(n_d)``, which before any sample is ``itl_d`` and does
not age); ``u_p``: ``L`` at a
prefiller that also decodes, else ``L`` less what ``p`` holds (index, else ``hit_p``);
``kept_d``: the uncached tokens kept at ``d``, decaying with time constant ``W`` (its
duty cycle); ``whole_p`` counts the queue whole (a spilling prefiller decodes what it
serves whole, which its hit rate misses).
``mean_d`` holds the mean stream to ``tpot * tpot_goal``; ``short_d`` bounds one local
prefill by what a short stream beside it tolerates: a stream of ``o_low`` tokens (the
``1 - attainment`` quantile of the outputs, learnt; before: ``out_mean * (1 -
attainment)``) that takes a whole stall of ``s`` seconds over its tokens runs at about
``step_d + s / o_low`` a token, so ``s <= (tpot - step_d) * o_low``. Without it a
prefill the mean stream absorbs sets the TPOT of every short stream beside it.

Hops. A request kept local pays ``2h`` (to the decoder, the first token back); P/D at
once ``4h`` (the prefill leg there and back, the decode leg there, the first token
back); served whole ``2h``. Every estimate is a TTFT less the first token's way back,
``h``, the hop all paths share: local ``+h`` (added in each target test, ``room = T*s -
wait - h``), remote ``+3h``, whole ``+h`` (``whole_p + h <= T``). So a local path keeps
``u`` within ``remote - h`` (local and remote compared alike) and ``T*s - wait - h``. One
test breaks the rule: a drain compares ``remote`` with ``wait + local``, one ``h`` short
(2 ms by default; kept as it is). Learning subtracts the real hops: a local sample
``ttft - 2h``, a P/D one its prefill leg's own time less ``2h``, from the leg's send to
its answer when the gateway timed it (else ``ttft - A - 2h``, ``A`` the time from the
prefill's answer to the first content when timed, else ``H(L) + 2h``; that also counts
what came before the leg: after a decoder rejected the prompt at its threshold, its
``2h`` and the decoder's wait, which on the CPU pair made a remote sample half as slow
again); the hand-over learns ``H`` from ``A - 2h``, fixed and per-token parts apart
(:mod:`~pd_orchestrator.policies.octave_line`).

The decision (:mod:`~pd_orchestrator.policies.goodput`) reads these: spill to
``argmin whole_p`` when ``d`` is crowded or queued; drain (P/D now, on the peer with the
least wait) when ``wait_d + h >= T*s`` and the remote path pays; else keep ``u`` up to
``u* = min(ttft limit, stall_d)`` and send ``t = 1 - (u* + 1/2) / L``.

Learning (:meth:`GoodputModel.observe`, :meth:`GoodputModel.keep`): per pool, the ITL
(an EWMA, ``alpha``) and the rates from served requests, each sample ``tokens / (ttft -
hops - transfer - attention)``; a rate is a bounded decaying maximum: the sample is
first clipped into ``[r / k, k * r]`` (``k = 1.5``), then ``r <- max(x, r + alpha * (x -
r))`` (a fast sample lifts it at once, by at most ``k``, queueing pulls it down slowly,
by at most ``alpha * (1 - 1/k)`` of it a sample), so no one sample, however far off,
moves a rate by more than x1.5. That suits a sample timed beside other work (streams
decoding, other prompts prefilling), which is slower than the engine by what that work
took: a bound, not a measure. A sample timed on an endpoint with nothing else running or
queued there (:attr:`LatencyObservation.alone`) measures the engine up to its jitter,
which is two-sided; the decaying maximum of such samples sits above the engine's rate by
about that jitter (on the CPU pair, 1.3x to 1.6x in the runs that missed the profile by
more than a quarter), so the rate moves instead to the peak of the last sixteen of them,
the fastest of their medians per octave of new tokens (across lengths, where the engine
runs fastest, as the maximum had it; at one length, the middle of its samples), by at
most x1.5. Where no profile or parameter gives the attention term ``a``, the pool learns
it from both paths' samples timed alone (:func:`_fit_attention`: the median slope of
seconds per new token against the mean context a new token attends to, between pairs of
one path's samples at lengths far enough apart, from its fastest octave on; a fixed cost
makes shorter ones slow), and each rate is read net of it; at one length, or before
eight such samples, it stays 0 (a linear model): learnt as linear, a 60k-token prompt's
local prefill was priced at half its time on the simulated H200, and kept on decoders
where it stalled their streams; learnt from fewer, one sample slowed by a prompt that
arrived while it prefilled taught four times the engine's term. Once a path (the local
one first) has eight such samples over three octaves or more, the pool fits the fixed
cost every prefill pays, the rate and the term together through one sample per octave
(:func:`_fit_prefill`, as the ``profile`` command fits an engine), and reads each rate
net of both: read as rate, the simulated H200's fixed 8 ms put the rate its start-up
prompts taught 3.6% short. A local sample is learnt
only when the decoder reported its cached count (``prompt_tokens_details``; None:
unknown, not learnt, as a warm prompt would pass for a whole prefill). A rate learns
only from a request whose prefilling endpoint (the decoder, or the P/D request's
prefiller) had nothing queued when it was planned (:attr:`LatencyObservation.queued`):
under sustained load every other sample times the queue too, and the decaying maximum
followed them down to a third of the engine's rate. A P/D sample counts what the
prefiller lacked when it reported its cached count (else the whole prompt, and then one
above twice the best known rate is a prompt the prefiller held, not learnt): counted
whole, the prompts a prefiller held taught a remote rate half as fast again as the
engine's (48,600 tokens/s against 33,900 on shared-prefix). ``m`` and ``o`` are EWMAs;
``o_low`` a stochastic quantile (:func:`_learn_quantile`). ``kept_d`` grows by the
uncached tokens of each request the final route keeps at ``d`` (told after composition);
the hit rates the decision read from readings are remembered until a reading gives
another.
Seeds: the known profile's (:attr:`Endpoint.knowledge`: the pool's measured profile
file, or the profile a simulator runs) rate, step, attention term (which follows the
learnt local rate once it is off the profile's: :meth:`PoolModel.learn_local`) and
hand-over, else
``prefill_tokens_per_s``, a linear model (its attention term learnt) and a hand-over at
``transfer_tokens_per_s``; a hardware label alone picks no profile; a pool with no
profile that has learnt no local sample (a prefill pool) takes no part in ``T``.
Before the first request, the gateway times cold prompts of its own on each pool with
no profile (:mod:`~pd_orchestrator.policies.calibration`, :meth:`GoodputModel.calibrate`):
learnt as samples timed alone, 2k to 32k tokens, they give the rates and the
attention term that a cold burst, planned before any of its requests has ended,
would otherwise price at the seeds, and those that generate ``probe_step_tokens``
tokens give a pool that decodes its step of one stream (:meth:`_learn_step`;
``S(n)`` flat at it until traffic teaches the line), which such a burst would
otherwise price at 0. The hit rate remembered at a probed endpoint is forgotten when
its probe ends (:meth:`GoodputModel.calibrated`).
:func:`knowledge_of` says which, and the gateway logs it per pool at start-up, shows
it in ``/status`` and in the ``pd_orchestrator_policy_knowledge`` gauge.
Measurements behind these choices: benchmarks/README.md.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Annotated

from pydantic import Field

from pd_orchestrator.model.endpoints import Endpoint
from pd_orchestrator.model.hardware import LatencyProfile
from pd_orchestrator.model.load import Candidate
from pd_orchestrator.model.measured import nonnegative_least_squares
from pd_orchestrator.policies.base import LatencyObservation, ThresholdContext
from pd_orchestrator.policies.calibration import Probe, Timed
from pd_orchestrator.policies.octave_line import OctaveLine
from pd_orchestrator.routing.registry import NoParams

__all__ = [
    "DutyCycle",
    "GoodputModel",
    "GoodputParams",
    "PoolModel",
    "knowledge_of",
    "on_clock",
    "profile_of",
    "seed_rate",
]

_Positive = Annotated[float, Field(gt=0.0, allow_inf_nan=False)]

_MIN_SAMPLE = 512
"""Prompt tokens below which a TTFT says more about fixed costs than about a rate."""


class GoodputParams(NoParams):
    """SLO targets ``ttft`` and ``tpot`` (seconds); ``slack``: the share of the TTFT target
    a local prefill may use when remote would be faster, the decoder wait from which it
    drains, and beside a spilling prefiller the share the remote path must fit in for
    the stall bound to apply;
    ``tpot_goal``: the share of ``tpot`` the mean stream is held to; the seeds
    ``prefill_tokens_per_s`` (when no profile is known) and ``transfer_tokens_per_s``
    (KV moved per second; None: the known profile's hand-over, its fixed and per-token
    costs, else 300,000, 40 GB/s at 128 KiB a token, and no fixed cost); ``hop`` (one
    leg's one-way latency), ``out_mean`` (the seed of the mean output, tokens),
    ``alpha`` (learning rate); ``prefill_attention``: seconds a prefilled token spends
    on each token before it (None: the known profile's when there is one, else learnt
    from samples timed alone, 0 until they show it). ``ttft_scale``: with k above 0, a
    prompt's TTFT target ``T`` scales with it, as an SLO set relative to the request
    alone does: the larger of ``ttft`` and k times its cold prefill alone on the fastest
    pool the model knows of for it (0: ``T`` is ``ttft`` for every prompt).
    ``probe_tokens``: the lengths of the cold prompts the gateway times at start-up on
    a pool with no profile that has learnt no local rate, each ``probe_repeats`` times,
    shortest first, none sent once ``probe_seconds`` have passed on that pool
    (:mod:`~pd_orchestrator.policies.calibration`; empty: none, it starts on the seeds),
    then on a pool that decodes the shortest length as many times again (three at
    least), streaming ``probe_step_tokens`` tokens, which times its decode step (0: not
    timed).
    ``attainment``: the share of requests the targets are to hold for; the short-stream
    bound protects the ``1 - attainment`` quantile of the outputs. ``time_scale``:
    seconds of the gateway's clock per second of the knowledge (a fleet of simulators
    run at ``--time-scale`` S: S; see :func:`on_clock`). See the module docstring."""

    ttft: _Positive = 1.0
    tpot: _Positive = 0.03
    slack: Annotated[float, Field(ge=0.0, le=1.0)] = 0.5
    prefill_tokens_per_s: _Positive = 20_000.0
    transfer_tokens_per_s: _Positive | None = None
    hop: Annotated[float, Field(ge=0.0, allow_inf_nan=False)] = 0.002
    out_mean: _Positive = 256.0
    alpha: Annotated[float, Field(gt=0.0, le=1.0)] = 0.05
    tpot_goal: Annotated[float, Field(gt=0.0, le=1.0)] = 0.6
    prefill_attention: Annotated[float, Field(ge=0.0, allow_inf_nan=False)] | None = None
    time_scale: _Positive = 1.0
    ttft_scale: Annotated[float, Field(ge=0.0, allow_inf_nan=False)] = 0.0
    attainment: Annotated[float, Field(gt=0.0, lt=1.0)] = 0.9
    probe_tokens: tuple[Annotated[int, Field(ge=_MIN_SAMPLE, le=1_000_000)], ...] = (
        2048, 4096, 8192, 16384, 32768,
    )  # fmt: skip
    probe_repeats: Annotated[int, Field(ge=1, le=8)] = 2
    probe_seconds: _Positive = 30.0
    probe_step_tokens: Annotated[int, Field(ge=0, le=1024)] = 32


def on_clock(params: GoodputParams) -> GoodputParams:
    """``params`` with its prior knowledge on the gateway's clock: ``hop`` and
    ``prefill_attention`` times ``time_scale``, the seeded rates divided by it (the
    known profile and the seeded hand-over are scaled where they are read,
    :meth:`GoodputModel.pool`); the
    targets ``ttft`` and ``tpot`` are the gateway's own already."""
    scale = params.time_scale
    if scale == 1.0:
        return params
    attention, transfer = params.prefill_attention, params.transfer_tokens_per_s
    return params.model_copy(
        update={
            "hop": params.hop * scale,
            "prefill_tokens_per_s": params.prefill_tokens_per_s / scale,
            "transfer_tokens_per_s": None if transfer is None else transfer / scale,
            "prefill_attention": None if attention is None else attention * scale,
        }
    )


def profile_of(endpoint: Endpoint) -> LatencyProfile | None:
    """The latency profile known for ``endpoint`` (:attr:`Endpoint.knowledge`: its
    pool's measured profile, or the simulator's it runs), if any. A hardware label
    alone picks none: the simulator's constants are no measurement of a real engine."""
    return None if endpoint.knowledge is None else endpoint.knowledge.profile


def knowledge_of(endpoint: Endpoint) -> str:
    """What the model of ``endpoint``'s pool starts from, in words: ``measured profile
    FILE``, ``simulator profile NAME`` (:attr:`Endpoint.knowledge`) or ``seeds``
    (``prefill_tokens_per_s``, a linear model, the seed hand-over; learnt from
    traffic, the attention term too)."""
    known = endpoint.knowledge
    return "seeds" if known is None else known.source


def seed_rate(endpoint: Endpoint, default: float) -> float:
    """Prefill tokens per second of ``endpoint`` by its known profile, else
    ``default``."""
    return _rate_of(profile_of(endpoint), default)


def _rate_of(profile: LatencyProfile | None, default: float) -> float:
    return 1.0 / profile.lin if profile is not None and profile.lin > 0 else default


def _mean(mean: float, sample: float, alpha: float) -> float:
    """An exponentially weighted mean; the first sample (``mean`` 0) is taken whole."""
    return sample if not mean else mean + alpha * (sample - mean)


def _learn_quantile(quantile: float, sample: float, level: float, alpha: float) -> float:
    """One step of a stochastic estimate of the ``level`` quantile: up by a factor
    ``exp(alpha * level)`` for a sample above it, down by ``exp(alpha * (1 - level))``
    for one at or below it, so it rests where ``level`` of the samples fall at or below;
    the first sample (``quantile`` 0) is taken whole. Multiplicative steps keep it on
    the samples' scale without a step size in tokens."""
    if quantile <= 0.0:
        return sample
    below = sample <= quantile
    return quantile * math.exp(alpha * (level - 1.0 if below else level))


def _learn_rate(rate: float, sample: float, alpha: float) -> float:
    """The bounded decaying maximum of the module docstring, for a sample timed beside
    other work: ``sample`` clipped into ``[rate / k, k * rate]`` (:func:`_clipped`)."""
    sample = _clipped(rate, sample)
    return max(sample, rate + alpha * (sample - rate))


Alone = tuple[int, int, float]
"""A sample timed alone (:func:`_learn_measured`): its new tokens, the tokens held
before them, and the seconds their prefill took (hops and hand-over taken off)."""


def _learn_measured(model: PoolModel, rate: float, sample: Alone, alone: list[Alone]) -> float:
    """A sample timed on an endpoint with nothing else there: it joins ``alone`` (the
    last :data:`_ALONE` such samples of its path, local or remote); where no profile or
    parameter gives the attention term, the pool learns it from both paths' samples
    (:func:`_fit_attention`); the rate moves from ``rate`` to their peak (:func:`_peak`),
    clipped as any sample."""
    alone.append(sample)
    del alone[:-_ALONE]
    if model.fits_attn:
        fitted = _fit_prefill(model.alone_local) or _fit_prefill(model.alone_remote)
        if fitted is None:
            model.attn = _fit_attention([model.alone_local, model.alone_remote], model.attn)
        else:
            model.fixed, model.attn = fitted
    peak = _peak(alone, model)
    return _clipped(rate, peak) if peak > 0 else rate


def _clipped(rate: float, sample: float) -> float:
    """``sample`` within ``[rate / k, k * rate]`` (``k``: :data:`_MAX_STEP`); as it is
    before any rate (``rate`` 0)."""
    if rate <= 0:
        return sample
    return min(max(sample, rate / _MAX_STEP), rate * _MAX_STEP)


def _peak(alone: list[Alone], model: PoolModel) -> float:
    """The fastest of the samples' medians per octave of their new tokens, each sample's
    rate net of ``model``'s fixed cost and attention term (0: no sample leaves time for
    a rate once they are taken off): across lengths the rate is the one where the engine runs
    fastest (where a fixed cost weighs least and the attention term, when not known,
    has not yet grown, what the decaying maximum followed), at one length the middle of
    its samples, so a jitter either way moves it by nothing once most of them agree."""
    octaves: dict[int, list[float]] = {}
    for new, held, seconds in alone:
        spent = seconds - model.fixed - model.attention_seconds(new, held)
        if spent > 0:
            octaves.setdefault(new.bit_length(), []).append(new / spent)
    return max((statistics.median(rates) for rates in octaves.values()), default=0.0)


def _fit_attention(paths: list[list[Alone]], attn: float) -> float:
    """The attention term the samples timed alone on ``paths`` show (``attn``: the one
    held, kept while they do not say). Each sample is a point ``(x, y)``, ``x = held +
    new / 2`` the mean context a new token attends to, ``y`` its seconds per new token,
    which a prefill at rate ``r`` with the term ``a`` makes ``1 / r + a * x``. Below the
    fastest octave of new tokens (by the median ``y`` of each) a fixed cost per prefill
    makes short prompts slow, which no attention explains, so only a path's samples
    from that octave on count, and the term is the median slope between pairs of them
    far enough apart (``x`` at least :data:`_APART` times the other's; each pair on one
    path, whose rate is one; at least :data:`_POINTS` samples and :data:`_PAIRS` pairs,
    else ``attn``): a sample slowed by work that arrived while it prefilled, or by
    jitter, moves a median by nothing; 0 at least, and at most the slope that leaves a
    path's fastest octave half its time per token for the linear part."""
    count, slopes, bound = 0, [], math.inf
    for alone in paths:
        octaves: dict[int, list[tuple[float, float]]] = {}
        for new, held, seconds in alone:
            octaves.setdefault(new.bit_length(), []).append((held + new / 2, seconds / new))
        if not octaves:
            continue
        medians = {o: statistics.median(y for _, y in group) for o, group in octaves.items()}
        fastest = min(medians, key=medians.__getitem__)
        points = [xy for octave, group in octaves.items() if octave >= fastest for xy in group]
        count += len(points)
        slopes += [(y2 - y1) / (x2 - x1) for x1, y1 in points for x2, y2 in points
                   if x2 >= _APART * x1]  # fmt: skip
        x0 = statistics.median(x for x, _ in octaves[fastest])
        bound = min(bound, medians[fastest] / (2.0 * x0))
    if count < _POINTS or len(slopes) < _PAIRS:
        return attn
    return min(max(statistics.median(slopes), 0.0), bound)


def _fit_prefill(alone: list[Alone]) -> tuple[float, float] | None:
    """``(fixed, attn)``: the cost every prefill pays whatever its length and the
    attention term, as the ``profile`` command fits a measured engine's (each octave of
    new tokens a point, the sample at the median of its seconds per new token; the
    non-negative least squares of ``fixed + new / r + attn * new * (held + new / 2)``
    through them, each weighted by its own time, so that a short prompt's jitter counts
    as much as a long one's). None where it cannot say: fewer than :data:`_POINTS`
    samples, fewer than :data:`_OCTAVES` octaves, or a fit with no rate, or a fixed
    cost above half the shortest point's time (a path whose short prompts were slowed
    by something else)."""
    if len(alone) < _POINTS:
        return None
    octaves: dict[int, list[Alone]] = {}
    for sample in alone:
        octaves.setdefault(sample[0].bit_length(), []).append(sample)
    if len(octaves) < _OCTAVES:
        return None
    points = [_median_sample(group) for group in octaves.values()]
    rows = [[1.0 / s, new / s, new * (held + new / 2) / s] for new, held, s in points]
    fixed, per_token, attn = nonnegative_least_squares(rows, [1.0] * len(points))
    if per_token <= 0.0 or fixed > 0.5 * min(s for *_, s in points):
        return None
    return fixed, attn


def _median_sample(group: list[Alone]) -> Alone:
    """The sample of ``group`` at the median of their seconds per new token (the lower
    middle one of an even count)."""
    ranked = sorted(group, key=lambda sample: sample[2] / sample[0])
    return ranked[(len(ranked) - 1) // 2]


_OCTAVES = 3
"""The fewest octaves of new tokens from which a fixed prefill cost is learnt beside the
attention term and the rate (:func:`_fit_prefill`)."""


_APART = 1.5
"""How much further one sample's context must be than another's for their pair to
say something of the attention term (:func:`_fit_attention`)."""

_PAIRS = 8
"""The fewest pairs of samples timed alone from which an attention term is learnt."""

_POINTS = 8
"""The fewest samples timed alone (from the fastest octave on) from which an attention
term is learnt."""


_ALONE = 16
"""The samples timed alone a rate keeps (:func:`_learn_measured`): enough for a median at
each of a few lengths, few enough that an engine that changed is followed within a
few dozen requests."""


_MAX_STEP = 1.5
"""The most one sample may multiply or divide a learnt rate by: see
:func:`_clipped`."""


_SEED_TRANSFER = 300_000.0
"""The seed of the transfer rate (tokens/s) with no profile known and none set."""

_OFF_PROFILE = 1.25
"""How far a learnt local rate may sit from the profile's and the profile's attention
term stand (:meth:`PoolModel.learn_local`): within it, the profile's engine under
load (the decaying maximum sits below the engine by the work beside its samples,
and the simulated H200's fixed costs put its rate 4% under the profile's); beyond
it, a profile off in speed."""

_HANDOVER_RECENT = 8
"""The samples each octave of the hand-over's line keeps (its median:
:mod:`~pd_orchestrator.policies.octave_line`)."""


def _handover(fixed: float, per_token: float) -> OctaveLine:
    """The hand-over's costs before any sample: ``fixed`` seconds and ``per_token``."""
    return OctaveLine(fixed, per_token, recent=_HANDOVER_RECENT)


@dataclass(slots=True)
class PoolModel:
    """What the model knows of one decoder pool: the local and remote prefill rates
    (tokens/s), the ITL observed there (seconds, None before any) and when its last
    sample came (``itl_at``, on the clock of :attr:`ThresholdContext.now`), the free chunk
    of its steps (tokens a step carries at no cost), its hardware profile, the
    rate both estimates were seeded with (0: none), the attention term of its
    prefills (seconds a prefilled token spends on each token before it; 0: linear),
    the hand-over's cost (:class:`OctaveLine`, fixed and per token, learnt apart)
    and, learnt where no profile is known, the ITL against the streams a batch
    holds (``steps``, fixed and per stream; empty before any); ``alone_local`` and
    ``alone_remote``, each rate's last samples timed alone (:func:`_learn_measured`);
    ``fits_attn``: whether ``attn`` is learnt from them (no profile or parameter gives
    it); ``measured``: whether a local sample has been learnt (before, a pool with no
    profile says nothing of a cold prefill: :meth:`GoodputModel.ttft_target`);
    ``fixed``: the seconds every prefill timed alone paid whatever its length, learnt
    with ``attn`` (:func:`_fit_prefill`) and taken off each sample before its rate is
    read; like a profile's fixed prefill cost, it prices nothing (a prefill beside
    streams rides steps they pay for); ``shape``: where the attention term is the
    profile's (no parameter sets it), that term times the profile's rate, from
    which :meth:`learn_local` derives the term (0: the term never follows the rate);
    ``probe_steps``: the decode steps of one stream the start-up timing read
    (:meth:`GoodputModel._learn_step`)."""

    rate_local: float
    rate_remote: float
    itl: float | None = None
    itl_at: float = 0.0
    free_tokens: float = 150.0
    profile: LatencyProfile | None = None
    seed: float = 0.0
    attn: float = 0.0
    handover: OctaveLine = field(default_factory=lambda: _handover(0.0, 1.0 / _SEED_TRANSFER))
    steps: OctaveLine = field(default_factory=OctaveLine)
    alone_local: list[Alone] = field(default_factory=list)
    alone_remote: list[Alone] = field(default_factory=list)
    fits_attn: bool = False
    measured: bool = False
    fixed: float = 0.0
    shape: float = 0.0
    probe_steps: list[float] = field(default_factory=list)

    def learn_local(self, rate: float) -> None:
        """Take ``rate`` as the local prefill rate. Where the attention term is the
        profile's (``shape`` above 0) and ``rate`` is more than :data:`_OFF_PROFILE`
        times off the profile's, the term follows at ``shape / rate``: a profile off
        by a factor in speed is off by it in both terms, and the local samples
        correct both (learnt alone, the rate absorbed the term's error and stayed 5%
        short); within it, the term stays the profile's."""
        self.rate_local = rate
        if self.shape > 0.0:  # seeded with a rate, so ``seed`` is above 0
            off = max(rate / self.seed, self.seed / rate) > _OFF_PROFILE
            self.attn = self.shape / (rate if off else self.seed)

    def attention_seconds(self, new: float, held: float) -> float:
        """The attention term of a prefill of ``new`` tokens after ``held`` cached ones:
        each new token attends to every token before it, at ``attn`` seconds a pair."""
        return self.attn * new * (held + new / 2)

    def prefill_seconds(self, rate: float, new: float, held: float) -> float:
        """Seconds to prefill ``new`` tokens after ``held`` cached ones at ``rate``
        tokens/s, attention included (0 with ``attn`` 0: a linear model)."""
        return new / rate + self.attention_seconds(new, held)

    def local_seconds(self, new: float, prompt: int) -> float:
        """Seconds a local prefill takes for ``new`` uncached tokens of a
        ``prompt``-token prompt (the rest cached); :meth:`tokens_within` inverts it."""
        return self.prefill_seconds(self.rate_local, new, prompt - new)

    def tokens_within(self, seconds: float, prompt: int) -> float:
        """The most uncached tokens ``u`` of a ``prompt``-token prompt (the rest cached)
        a local prefill does within ``seconds``: the root of
        ``prefill_seconds(rate_local, u, prompt - u) = seconds``, which grows with
        ``u``; ``prompt`` when the whole prompt fits, linear below 0 seconds."""
        rate, attn = self.rate_local, self.attn
        if attn <= 0.0 or seconds <= 0.0:
            return seconds * rate
        if seconds >= self.local_seconds(prompt, prompt):
            return float(prompt)
        b = 1.0 / rate + attn * prompt
        return (b - math.sqrt(b * b - 2.0 * attn * seconds)) / attn


@dataclass(slots=True)
class DutyCycle:
    """Uncached prompt tokens kept at one decoder, decaying with a time constant:
    about the tokens kept over the last window."""

    tokens: float = 0.0
    at: float = 0.0

    def decayed(self, now: float, window: float) -> float:
        """The count at ``now`` (a clock that went back decays nothing)."""
        return self.tokens * math.exp(-max(0.0, now - self.at) / window)

    def add(self, now: float, tokens: float, window: float) -> None:
        self.tokens = self.decayed(now, window) + tokens
        self.at = max(self.at, now)


def _seeded_pool(profile: LatencyProfile | None, params: GoodputParams) -> PoolModel:
    """A pool's model before anything is learnt: from ``profile`` (already on the
    gateway's clock) when known, else from the seeds in ``params``."""
    rate = _rate_of(profile, params.prefill_tokens_per_s)
    attn = params.prefill_attention
    fits = attn is None and profile is None
    if attn is None:
        attn = profile.attn if profile is not None else 0.0
    if profile is not None:
        handover = _handover(profile.a_kv, profile.transfer_seconds(1) - profile.a_kv)
    else:
        handover = _handover(0.0, params.time_scale / _SEED_TRANSFER)
    shape = attn * rate if profile is not None and params.prefill_attention is None else 0.0
    return PoolModel(
        rate, rate, profile=profile, seed=rate, attn=attn, handover=handover,
        fits_attn=fits, shape=shape,
    )  # fmt: skip


@dataclass(slots=True)
class GoodputModel:
    """The cost model of the module docstring: the learnt state (``pools``, ``duty``,
    ``hits``, ``prompt_mean``, ``out_mean``), the estimates (pure reads) and the
    learning rule (:meth:`observe`, :meth:`keep`, :meth:`saw`). No decisions."""

    params: GoodputParams = field(default_factory=GoodputParams)
    pools: dict[str, PoolModel] = field(default_factory=dict)
    duty: dict[str, DutyCycle] = field(default_factory=dict)
    hits: dict[str, float] = field(default_factory=dict)
    prompt_mean: float = 0.0
    out_mean: float = 0.0
    out_low: float = 0.0
    others: dict[str, DutyCycle] = field(default_factory=dict)
    """What the other gateways' policies of this name kept per decoder (:meth:`share`)."""
    reads: list[Candidate] | None = field(default=None, compare=False, repr=False)
    """While not None, :meth:`hit_rate` lists here the candidates whose reading gave
    the rate it returned (what :meth:`saw` then remembers); None while deciding."""

    def pool(self, endpoint: Endpoint) -> PoolModel:
        """``endpoint``'s pool, seeded on first use (its seed depends on nothing learnt)."""
        model = self.pools.get(endpoint.pool)
        if model is None:
            profile = profile_of(endpoint)
            if profile is not None:
                profile = profile.on_clock(self.params.time_scale)
            model = self.pools[endpoint.pool] = _seeded_pool(profile, self.params)
        return model

    def handover(self, model: PoolModel, tokens: float) -> float:
        """``H(L)``: seconds the KV of a ``tokens``-token prompt takes to reach the
        decoder: at ``transfer_tokens_per_s`` when set (no fixed cost), else the pool's
        (its profile's, else the seed's)."""
        rate = self.params.transfer_tokens_per_s
        return tokens / rate if rate is not None else model.handover.at(tokens)

    def learnt(self) -> dict[str, dict[str, float | None]]:
        """Per pool, what the model holds now (rates in tokens/s, seconds otherwise;
        the step learnt against the batch None where none is, as with a profile; the
        samples timed alone each rate keeps, a count)."""
        return {
            name: {
                "rate_local": round(pool.rate_local, 1),
                "rate_remote": round(pool.rate_remote, 1),
                "itl": pool.itl,
                "handover_fixed": pool.handover.fixed,
                "handover_per_token": pool.handover.slope,
                "step_fixed": pool.steps.fixed if pool.steps.octaves else None,
                "step_per_stream": pool.steps.slope if pool.steps.octaves else None,
                "attention": pool.attn,
                "prefill_fixed": pool.fixed,
                "alone_local": len(pool.alone_local),
                "alone_remote": len(pool.alone_remote),
            }
            for name, pool in sorted(self.pools.items())
        }

    def inherit(self, previous: GoodputModel) -> None:
        """Take ``previous``'s learnt state (a reload: the parameters stay these)."""
        self.pools, self.duty, self.hits = previous.pools, previous.duty, previous.hits
        self.prompt_mean, self.out_mean = previous.prompt_mean, previous.out_mean
        self.out_low = previous.out_low

    # -- the estimates (seconds) -------------------------------------------------------------
    def hit_rate(self, candidate: Candidate) -> float | None:
        """``candidate``'s prefix-cache hit rate: its reading's, else the last one a
        reading gave (:meth:`saw`); None when no reading ever gave one."""
        load = candidate.load
        rate = load.prefix_hit_rate if load is not None else None
        if rate is None:
            return self.hits.get(candidate.endpoint.name)
        if self.reads is not None:
            self.reads.append(candidate)
        return rate

    def ttft_target(self, context: ThresholdContext, model: PoolModel) -> float:
        """``T``: the prompt's TTFT target, ``ttft``; with ``ttft_scale`` k > 0 the larger
        of it and k times the prompt's cold prefill alone on the fastest hardware the
        model knows of for it: the decoder's pool (``model``) or a prefiller's, each at
        its own local rate (a remote rate, learnt from P/D samples whose prefiller may
        have held part of the prompt, is no measure of a cold prefill); a prefiller's
        pool with no profile counts once it has learnt a local sample (before, its seeds
        are a guess: a linear seed made every long prompt's target tighter than the
        decoders' learnt attention term gives)."""
        p = self.params
        if p.ttft_scale <= 0.0:
            return p.ttft
        tokens = context.prompt_tokens
        alone = model.local_seconds(tokens, tokens)
        for prefiller in context.prefillers:
            pool = self.pool(prefiller.endpoint)
            if pool.profile is not None or pool.measured:
                alone = min(alone, pool.local_seconds(tokens, tokens))
        return max(p.ttft, p.ttft_scale * alone)

    def remote_ttft(self, context: ThresholdContext, model: PoolModel) -> float | None:
        """``remote``: the TTFT through the best compatible prefiller (None: none)."""
        path = self.remote_path(context, model)
        return None if path is None else path[0]

    def remote_path(
        self, context: ThresholdContext, model: PoolModel
    ) -> tuple[float, str | None] | None:
        """``remote`` and the prefiller it assumes: the first of the compatible
        prefillers that answers soonest by the ``min`` term; None where every one
        answers as soon, or where that one also serves streams (a spilling pool's, or
        one that decodes: a prefill there stalls its streams, which ``remote`` does
        not price, and the prefill ranking's queue depth and KV usage count them), so
        the ranking picks. None when there is no prefiller."""
        if not context.prefillers:
            return None
        tokens, p = context.prompt_tokens, self.params
        mean = self.prompt_mean or tokens
        seconds = [self._remote_seconds(context, c, mean, model) for c in context.prefillers]
        prefill = min(seconds)
        best = context.prefillers[seconds.index(prefill)].endpoint
        streams = best.spill or best.role.decodes
        named = None if streams or prefill == max(seconds) else best.name
        return prefill + self.handover(model, tokens) + 3 * p.hop, named

    def _remote_seconds(
        self, context: ThresholdContext, prefiller: Candidate, mean: float, model: PoolModel
    ) -> float:
        """Seconds ``prefiller`` computes before this prompt's first token, at the
        pool's remote rate (the ``min`` term of ``remote``)."""
        hit = self.hit_rate(prefiller) or 0.0
        tokens, rate = context.prompt_tokens, model.rate_remote
        queued = max(prefiller.backlog, _outstanding(prefiller) * mean) * (1.0 - hit)
        own = (
            tokens if prefiller.endpoint.role.decodes else self.uncached_on(context, prefiller, hit)
        )
        return queued / rate + model.prefill_seconds(rate, own, tokens - own)

    def uncached_on(self, context: ThresholdContext, prefiller: Candidate, hit: float) -> float:
        """The prompt's tokens ``prefiller`` lacks: less what the prefix index says it
        holds when the planner has one, else less its hit rate ``hit``."""
        tokens = context.prompt_tokens
        cached = context.cached_on(prefiller.endpoint)
        return tokens * (1.0 - hit) if cached is None else tokens - min(cached, tokens)

    def queue_share(self, context: ThresholdContext) -> float:
        """``q_d``: the cached share of the prompts queued at the context's decoder."""
        hit = self.hit_rate(context.decoder)
        routed = context.decoder.endpoint.spill
        return _queue_share(hit, context.cached_tokens, context.prompt_tokens, routed=routed)

    def uncached(self, context: ThresholdContext) -> float:
        """``u``: the prompt's tokens the decoder lacks (the index's count, else by
        :meth:`queue_share`)."""
        cached, tokens = context.cached_tokens, context.prompt_tokens
        return tokens - cached if cached is not None else tokens * (1.0 - self.queue_share(context))

    def queued(self, decoder: Candidate, tokens: int, model: PoolModel, hit: float) -> float:
        """``wait``: seconds of prefill queued at ``decoder`` at hit rate ``hit``: the
        gateway's backlog there, plus the mean prompt (``tokens``, the prompt's, before
        one is learnt) for each request its reading counts waiting beyond the gateway's
        own in flight."""
        load = decoder.load
        backlog: float = decoder.backlog
        if load is not None and load.waiting:
            others = min(load.waiting, _outstanding(decoder) - decoder.in_flight)
            backlog += others * (self.prompt_mean or tokens)
        return backlog * (1.0 - hit) / model.rate_local

    def whole_seconds(
        self, context: ThresholdContext, prefiller: Candidate, pool: PoolModel
    ) -> float:
        """``whole_p``: seconds before ``prefiller`` (of ``pool``) would answer the
        request served whole there."""
        tokens = context.prompt_tokens
        uncached = self.uncached_on(context, prefiller, self.hit_rate(prefiller) or 0.0)
        return self.queued(prefiller, tokens, pool, 0.0) + pool.local_seconds(uncached, tokens)

    def output_tokens(self) -> float:
        """``o``: a stream's mean output in tokens (learnt, or the ``out_mean`` seed)."""
        return self.out_mean or self.params.out_mean

    def short_output(self) -> float:
        """``o_low``: the output length of a short stream, the ``1 - attainment``
        quantile of the outputs (learnt, or ``out_mean`` times ``1 - attainment``)."""
        p = self.params
        return self.out_low or self.output_tokens() * (1.0 - p.attainment)

    def window(self) -> float:
        """``W``: seconds a stream decodes for within the TPOT target (the duty cycle's
        window)."""
        return self.output_tokens() * self.params.tpot

    def local_share(self, decoder: Candidate, now: float, model: PoolModel) -> float:
        """``share_d``: the share of the decoder's time its kept prefills take: what
        this policy kept there and what the other gateways' did (:meth:`share`)."""
        name = decoder.endpoint.name
        cycles = [c for c in (self.duty.get(name), self.others.get(name)) if c is not None]
        if not cycles:
            return 0.0
        window = self.window()
        return sum(c.decayed(now, window) for c in cycles) / (window * model.rate_local)

    def stall_limit(self, context: ThresholdContext, model: PoolModel) -> float:
        """``stall_d``: the most uncached tokens a local prefill may have before the
        streams decoding on the decoder miss their TPOT (inf: none decodes there): the
        smaller of ``mean_d`` and ``short_d`` (module docstring; ``short_d`` takes no
        part when the whole prompt fits), never less than the tokens a step carries for
        free. The observed ITL carries the current share, so the bare step is ``itl *
        (1 - share)``; ``mean_d`` is what is left of the allowed share over a window,
        in tokens."""
        count = context.decoder.streams
        if count == 0:
            return math.inf
        p = self.params
        share = self.local_share(context.decoder, context.now, model)
        step = self._bare_step(context, model, count, share)
        allowed = 1.0 - step / (p.tpot * p.tpot_goal)
        mean = (allowed - share) * self.window() * model.rate_local
        return max(model.free_tokens, min(mean, self._short_limit(context, model, step)))

    def _short_limit(self, context: ThresholdContext, model: PoolModel, step: float) -> float:
        """``short_d`` at a bare step of ``step`` seconds (inf: the whole prompt fits)."""
        prompt = context.prompt_tokens
        seconds = (self.params.tpot - step) * self.short_output()
        if seconds >= model.local_seconds(prompt, prompt):
            return math.inf
        return model.tokens_within(seconds, prompt)

    def _bare_step(
        self, context: ThresholdContext, model: PoolModel, count: int, share: float
    ) -> float:
        """A decode step without prefill at the decoder with ``count`` streams: the
        observed ITL (:meth:`recent_itl`) less the prefill share, or the profile's step,
        the larger; with no profile, the larger of the observed ITL and the one learnt
        at ``count`` (:meth:`stream_step`), less the share (both carry it: under rising
        load the mean ITL lags behind the batch, and a step read from it lets prefills
        land beside more streams than it priced)."""
        bare = 1.0 - min(share, _MAX_SHARE)
        observed = self.recent_itl(model, context.now)
        step = self.stream_step(model, context.prompt_tokens, count)
        if model.profile is None:  # the learnt step, like the ITL, carries the share
            return max(observed, step) * bare
        return max(observed * bare, step)

    def recent_itl(self, model: PoolModel, now: float) -> float:
        """The pool's observed ITL as evidence of its step at ``now`` (0 before any),
        decaying with the time since its last sample, with time constant ``W``, towards
        the step the pool otherwise knows (:meth:`stream_step`, the larger of the two
        sets the bare step): a sample times the streams decoding over the window before
        it, with the prefill share of that window, which :meth:`local_share` decays
        alike; once they have finished it says nothing of the streams decoding now
        (after an idle spell, the ITL of the last busy one would hold the stall bound at
        the free chunk). That step is the profile's, or without one the ITL learnt
        against the batch, and before a sample of it the pool's ITL undecayed: once an
        ITL is learnt, a step beside a decoding stream is never priced free (on the CPU
        pair a cold prompt was prefilled beside a stream while the ITL, the only measure
        then, decayed to nothing)."""
        if model.itl is None:
            return 0.0
        return model.itl * math.exp(-max(0.0, now - model.itl_at) / self.window())

    def stream_step(self, model: PoolModel, prompt: int, count: int) -> float:
        """A decode step with ``count`` streams: the hardware profile's, with no prefill
        (each stream of the mean prompt, ``prompt`` before one is learnt, and half the
        mean output); else the ITL learnt against the batch (``steps``) at ``count``,
        else the pool's observed ITL (0 before any)."""
        if model.profile is None:
            return model.steps.at(count) if model.steps.octaves else model.itl or 0.0
        per_stream = (self.prompt_mean or prompt) + self.output_tokens() / 2
        return model.profile.step_seconds(round(count * per_stream), count)

    # -- learning ----------------------------------------------------------------------------
    def saw(self, candidates: Iterable[Candidate]) -> None:
        """Remember the hit rate each of ``candidates``' readings gives."""
        for candidate in candidates:
            load = candidate.load
            if load is not None and load.prefix_hit_rate is not None:
                self.hits[candidate.endpoint.name] = load.prefix_hit_rate

    def kept_now(self, now: float) -> dict[str, float]:
        """The uncached tokens this policy kept per decoder, decayed to ``now`` (what
        its gateway reports to the others; decoders with under one token left out)."""
        window = self.window()
        kept = {name: duty.decayed(now, window) for name, duty in self.duty.items()}
        return {name: round(tokens, 1) for name, tokens in kept.items() if tokens >= 1.0}

    def share(self, kept: Mapping[str, float], now: float) -> None:
        """What the other gateways' policies of this name kept per decoder, as of
        ``now`` (empty: this policy counts its own alone)."""
        self.others = {name: DutyCycle(tokens, now) for name, tokens in kept.items()}

    def keep(self, decoder: Endpoint, now: float, uncached: float) -> None:
        """Count ``uncached`` tokens a request's final route keeps at ``decoder``."""
        duty = self.duty.get(decoder.name)
        if duty is None:
            duty = self.duty[decoder.name] = DutyCycle()
        duty.add(now, uncached, self.window())

    def observe(self, observation: LatencyObservation) -> None:
        """Learn the pool's ITL, the means and the rates from a finished request."""
        model = self.pools.get(observation.pool)
        if model is None:
            return
        alpha = self.params.alpha
        if observation.itl is not None:
            model.itl = _mean(model.itl or 0.0, observation.itl, alpha)
            model.itl_at = max(model.itl_at, observation.now)
            if model.profile is None and observation.streams is not None:
                model.steps.learn(observation.streams + 1, observation.itl, alpha)
        if observation.prompt_tokens:
            self.prompt_mean = _mean(self.prompt_mean, observation.prompt_tokens, alpha)
        if observation.output_tokens:
            self.out_mean = _mean(self.out_mean, observation.output_tokens, alpha)
            level = 1.0 - self.params.attainment
            self.out_low = _learn_quantile(self.out_low, observation.output_tokens, level, alpha)
        self._learn_rates(observation, model)

    def unknown(self, endpoint: Endpoint) -> bool:
        """Whether ``endpoint``'s pool has no profile and has learnt no local rate (what
        the gateway times at start-up: :mod:`~pd_orchestrator.policies.calibration`)."""
        if profile_of(endpoint) is not None:
            return False
        model = self.pools.get(endpoint.pool)
        return model is None or not model.measured

    def calibrate(self, probe: Probe, timed: Timed) -> None:
        """Learn a probe prompt the gateway timed itself, as a served request's rates are
        learnt and nothing else (no means, no ITL: it is no client's request): a local
        sample of the probed endpoint's pool, and a remote one of each decoder pool
        :attr:`Probe.decoders` names; a pool with a profile learns nothing of it. The
        decode step prompt (:attr:`Timed.output` above 1) teaches its pool the step
        of one stream instead (:meth:`_learn_step`)."""
        if timed.output > 1:
            self._learn_step(probe.endpoint, timed)
            return
        local = LatencyObservation(
            "", probe.endpoint.pool, 0.0, timed.seconds, prompt_tokens=timed.tokens,
            cached_tokens=timed.cached, remote=False, queued=timed.queued, alone=timed.alone,
        )  # fmt: skip
        targets = [(probe.endpoint, local)]
        for decoder in probe.decoders:
            remote = replace(
                local, pool=decoder.pool, remote=True, cached_tokens=None,
                prefill_cached=timed.cached, prefill_seconds=timed.seconds,
            )  # fmt: skip
            targets.append((decoder, remote))
        for endpoint, observation in targets:
            if profile_of(endpoint) is None:
                self._learn_rates(observation, self.pool(endpoint))

    def calibrated(self, endpoint: str) -> None:
        """The probe on ``endpoint`` (a name) has ended: forget the hit rate remembered
        there. A reading whose window held the probe's cold prompts counts their misses
        as the endpoint's, and a rate it gave would stand until a reading gives another
        (on a cold burst, all of it: on the simulated mixed fleet the probed endpoints'
        hit rate of 0 cost the burst 6 points of attainment at x18)."""
        self.hits.pop(endpoint, None)

    def _learn_step(self, endpoint: Endpoint, timed: Timed) -> None:
        """The decode step of one stream from a probe that generated ``timed.output``
        tokens, on a pool with no profile: the mean gap between its streamed tokens
        (``timed.gap``); not streamed, its time less the two hops and its prefill (the
        fixed cost, the rate and the attention term learnt so far) over the steps
        after the first token, where the pool has learnt a local rate (a prefill
        priced on the seeds could take any share of the time). Where it leaves a step
        (a prompt the rates misjudge by more than the steps took teaches nothing), the
        median of the probe's steps so far (``probe_steps``) is the pool's step at one
        stream (``steps``). The gap, as the step is read apart from the prefill: on
        the CPU pair a prefill priced 13% dear (40 ms) left 0.7 ms of a 6 ms step. The
        median, of three or more (:meth:`Probe.prompts`): there, one step prompt the
        host slowed read 12.4 ms against the 5.0 ms the decoder streamed at around it,
        and the least of eight read 23% under the ITL streamed around them."""
        model = self.pool(endpoint)
        if model.profile is not None:
            return
        step = timed.gap if timed.gap is not None else self._step_left(model, timed)
        if step is not None and step > 0.0:
            model.probe_steps.append(step)
            model.steps.place(1, statistics.median(model.probe_steps))

    def _step_left(self, model: PoolModel, timed: Timed) -> float | None:
        """A step prompt's time less its hops and priced prefill, over its steps after
        the first token (None: no local rate learnt, or no cached count)."""
        if not model.measured or timed.cached is None:
            return None
        new = timed.tokens - min(timed.cached, timed.tokens)
        prefill = model.fixed + model.local_seconds(new, timed.tokens)
        return (timed.seconds - 2 * self.params.hop - prefill) / (timed.output - 1)

    def _learn_rates(self, observation: LatencyObservation, model: PoolModel) -> None:
        ttft, tokens = observation.ttft, observation.prompt_tokens
        if ttft is None or not tokens or observation.remote is None:
            return
        p = self.params
        if observation.remote:
            self._learn_handover(observation, model)
        if observation.queued:  # it timed the queue ahead of it as well as the engine
            return
        if observation.remote:
            held = observation.prefill_cached
            own = tokens if held is None else tokens - min(held, tokens)
            seconds = self._prefill_leg(observation, model, ttft) - 2 * p.hop
            rate = _rate_sample(model, own, tokens - own, seconds)
            if rate is not None and (held is not None or rate <= _plausible(model)):
                if observation.alone:
                    sample = (own, tokens - own, seconds)
                    model.rate_remote = _learn_measured(
                        model, model.rate_remote, sample, model.alone_remote
                    )
                else:
                    model.rate_remote = _learn_rate(model.rate_remote, rate, p.alpha)
        elif observation.cached_tokens is not None:
            cached = observation.cached_tokens
            seconds = ttft - 2 * p.hop
            rate = _rate_sample(model, tokens - cached, cached, seconds)
            if rate is not None:
                model.measured = True
                if observation.alone:
                    sample = (tokens - cached, cached, seconds)
                    model.learn_local(
                        _learn_measured(model, model.rate_local, sample, model.alone_local)
                    )
                else:
                    model.learn_local(_learn_rate(model.rate_local, rate, p.alpha))

    def _prefill_leg(self, observation: LatencyObservation, model: PoolModel, ttft: float) -> float:
        """Seconds a P/D request's prefill leg took, its two hops included: as timed from
        its send when the gateway timed it, else its TTFT ``ttft`` less the time after
        the prefill's answer (:attr:`LatencyObservation.after_prefill`, else the
        hand-over and two hops), which also counts what came before the leg."""
        if observation.prefill_seconds is not None:
            return observation.prefill_seconds
        after = observation.after_prefill
        if after is None:
            after = self.handover(model, observation.prompt_tokens or 0) + 2 * self.params.hop
        return ttft - after

    def _learn_handover(self, observation: LatencyObservation, model: PoolModel) -> None:
        """Learn the hand-over's costs from a P/D request whose prefill answer time is
        known: the TTFT after it less the decode leg's two hops (module docstring)."""
        after, tokens = observation.after_prefill, observation.prompt_tokens
        if after is None or not tokens or self.params.transfer_tokens_per_s is not None:
            return
        model.handover.learn(tokens, after - 2 * self.params.hop, self.params.alpha)


def _rate_sample(model: PoolModel, new: int, held: int, seconds: float) -> float | None:
    """The rate ``new`` tokens prefilled after ``held`` cached ones in ``seconds`` show,
    net of the fixed cost and the attention term (None: too few tokens to say, or no
    time left)."""
    spent = seconds - model.fixed - model.attention_seconds(new, held)
    return new / spent if new >= _MIN_SAMPLE and spent > 0 else None


def _plausible(model: PoolModel) -> float:
    """The fastest remote prefill rate a sample may show and be learnt: a multiple of
    the best the pool has known (its seed, its local rate). A remote sample counts the
    whole prompt, as the gateway does not learn what the prefiller had cached; a much
    faster one is a prompt the prefiller held (a re-asked document), not a faster
    engine, and the decaying maximum would keep it for many samples."""
    return _CACHED_FACTOR * max(model.seed, model.rate_local)


_CACHED_FACTOR = 2.0
"""See :func:`_plausible`."""

_MAX_SHARE = 0.9
"""The prefill share above which the observed ITL says little of the bare step."""


def _queue_share(hit: float | None, cached: int | None, tokens: int, *, routed: bool) -> float:
    """The cached share of the prompts queued at the decoder: its reading's hit rate;
    before any reading, this prompt's own cached share (the prefix index's), else 0
    (every queued prompt uncached, an upper bound). At a spilling prefiller the
    routing picked (``routed``), the larger of the two: the routing picked it for the
    prefix it holds, so its queue is mostly this prompt's neighbours, while its
    reading also counts the cold prompts decoders spilled or drained to it."""
    own = cached / tokens if cached is not None and tokens > 0 else None
    if hit is None:
        return 0.0 if own is None else own
    if routed and own is not None:
        return max(hit, own)
    return hit


def _outstanding(candidate: Candidate) -> int:
    """Requests at a prefiller: the gateway's own count or a reading, the larger."""
    load = candidate.load
    if load is None:
        return candidate.in_flight
    return max(candidate.in_flight, load.running + load.waiting)
