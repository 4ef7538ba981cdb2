"""``goodput``: a cost model in seconds -- prefill where the request meets its SLO at
the least cost to everyone else.

For the chosen decoder and a prompt of ``L`` tokens, ``u`` of them uncached there:

* **wait** at the decoder: the prompt tokens queued there before this one (its
  *backlog*: the gateway's own requests sent there that have had no first answer
  yet, or what a reading's ``waiting`` counts times the mean prompt, the larger: a
  reading carries what other gateways sent), less its prefix-cache hit rate, over its
  prefill rate. Both paths pay it: the decode attempt is admitted or rejected only
  when the decoder's scheduler reaches it. A hit rate (the decoder's, a
  prefiller's) stands until a reading gives another: a window with no prompt, or a
  stale or missed scrape, leaves the cache as it was.
* **remote** (P/D), beyond that wait: the best compatible prefiller's backlog and the
  prompt itself, less that prefiller's hit rate, at its rate, the KV transfer and the
  extra legs::

      remote = min over p of (backlog_p + L) * (1 - hit_p) / rate_p
               + L / transfer_rate + 3 * hop

  (the prompt's own share at the prefill time below, with its attention).
  A prefiller that also decodes (role ``both``) reports the hit rate of its own
  conversations, which the router keeps there; a prompt sent to it for P/D is another
  conversation's, so its hit rate takes its share off the backlog only:
  ``(backlog_p * (1 - hit_p) + L) / rate_p``. Where the planner has the prefix index,
  the prompt's own share is what the index says the prefiller holds of it, not its
  hit rate: a reading stands until another gives a hit rate, and one from a window of
  re-asked documents (near 1) priced every later prompt there as free. Measured on
  long-doc on 8:8 H200 at x0.0625, the estimate said 0.1 s for 30,000 uncached
  tokens, and 66 of 240 requests went P/D (67.9% within the SLO; with the index's
  count, 22 and 71.2%, decode-only's 71.2%; both with the other changes of the same
  release).

* **prefill time**: ``u`` new tokens after ``c`` cached ones take
  ``u / rate + a * u * (c + u / 2)`` seconds: each new token also attends to every
  token before it, at ``a`` seconds a pair (``prefill_attention``; by default the
  hardware profile's, 0 without one: a linear model). A linear model prices a
  25,000-token prompt 29% short on H200, and learns its rate 12-17% low from long
  prompts (a rate is a decaying maximum, below): on long-doc on the mixed fleet, the
  local rate fell to 27,000-29,000 tokens/s while the remote one, sampled by fewer
  P/D requests, stayed at 30,000-32,000, so 21,000-23,000-token prompts on an idle
  fleet went P/D on estimates 1% faster than local and missed the target by the
  transfer (1.00-1.05 s, where a local prefill took 0.91-0.96 s: 67.1% within the
  SLO at x0.0312, decode-only 69.6%; with the attention term, 69.6%). The queues
  stay linear (a token queued costs ``1 / rate``): pricing the queued prompts'
  attention as well (each of the mean prompt, the decoder's hit rate cached) cost
  shared-prefix 400 on 8:8 2.8 points over three draws near its frontier.

* **local**, beyond that wait: the prefill of ``u``. ``u`` is the prompt less what the
  decoder holds of it by the gateway's prefix index
  (:attr:`~pd_orchestrator.policies.base.ThresholdContext.cached_tokens`, a precise
  index fed by the servers' KV events) when the planner has one, else the prompt
  less the decoder's hit rate. Before any reading gives a hit rate, the prompt's
  own cached share stands for the queue's too. The gateway's index also counts the
  blocks of the prompts it sent to an endpoint that have had no first answer yet:
  the server holds them by the time it reaches this prompt, though no KV event has
  said so. In a cold burst of one prefix, the prompts queued behind the first were
  otherwise counted uncached, with the queue they joined: on shared-prefix with 400
  requests on mixed at x26.9 (first draw), a routed pick priced 28,000-31,000
  queued tokens of its own prefix at 0.86-0.96 s and declined 12 requests to
  decoders that then missed 16 (benchmarks/README, "The current matrix").
* **stall**: what local prefills cost the streams decoding there. It is a rate,
  not one prompt's cost: a stream decodes for about ``W = out_mean * tpot`` seconds,
  and every prefill kept at its decoder meanwhile lands on it. If a share ``s`` of
  the decoder's time goes to prefill, a step of ``step`` seconds becomes
  ``step / (1 - s)`` per output token. The policy counts the uncached tokens it kept
  at each decoder over the last ``W`` (its *duty cycle*, decaying with time constant
  ``W``), so ``s = kept / (W * rate_d)``; the observed ITL already carries that
  share, so ``step = itl_d * (1 - s)``. That ITL is the pool's mean over finished
  requests: it lags a decoder whose streams have grown. So where the hardware profile
  is known, ``step`` is at least the profile's decode step for this decoder's streams
  now (each of the mean prompt and half the mean output). Measured on shared-prefix
  with 1024 requests on 8:8 H200 at x4: the pool's ITL read 11-17 ms while a decoder
  holding about 150 streams of 4-5k tokens needs about 30 ms a step before any
  prefill; the budget let 80% of the prompts prefill on their decoder, and 549
  requests missed TPOT (46.4% attainment; with the profile's step, 99.4%).
  Per-request TPOTs still spread around the mean (a burst, the streams' own
  lengths), so the mean is held to ``tpot * tpot_goal``: the share allowed is
  ``1 - step / (tpot * tpot_goal)``, and what is left of it over a window is the
  most a local prefill may add, never less than the ``free`` tokens a memory-bound
  step carries at no cost. The count is this
  process's own: with several gateway workers or replicas, each holds its decoders
  to the share of the traffic it sees (the wait, by contrast, also reads what the
  servers report).

A decoder whose wait already spends its share of the TTFT target (``wait + hop >=
ttft * slack``) may drain: the policy sends threshold 1, which no prompt meets, so the
gateway skips the decode attempt and the request goes P/D at once; the prompt's
prefill leaves the decoder's queue, which drains (reason ``drain``). A request that
skips the attempt needs no prefix of the decoder's own, and its decode leg would
wait behind the same queue (its TTFT is about the longer of the two paths), so the
decision names the peer -- a ranked decoder the same prefillers reach -- where it
starts soonest: the least prefill queued there (:meth:`GoodputPolicy.soonest`).
Measured on the Mooncake trace (with the sample bound below), this moved mean
attainment over nine rates from 76.0% to 78.4% on 12:4 H200, from 73.4% to 77.9% on
8:8 and from 70.5% to 75.6% on the mixed fleet (decode-only: 76.1%, 73.4%, 72.5%).
It drains only to a dedicated prefiller (role ``prefill``), only to a remote path
that meets the TTFT target (``remote <= ttft``), and only when that path is the
faster one (``remote <= wait + u / rate_d``) or the local path misses the target
anyway (``wait + u / rate_d > ttft``). A drain whose remote path misses too only
moves the miss onto a prefiller whose other work (its P/D prefills, the requests it
serves whole) then waits behind it: measured on shared-prefix with 400 requests on
the mixed fleet at x16, where a group's two prefillers took 51 drains and 61 whole
requests in the burst's first half-second, 43 of the drained and 34 of the whole
requests missed TTFT (80.8% of requests within the SLO; with this condition, 97.2%).
Before any reading gave the decoder's hit rate, and without the prefix index's
count, the wait counts its whole backlog as uncached, an upper bound: then it drains
only to a remote path that is faster and within ``ttft * slack``. Otherwise the
prompt stays local (reason ``queued``):

* every compatible prefiller also decodes: draining moves the prompt to a queue of
  the same decode-first work (measured on the Mooncake trace, draining there cost
  2-3 points of attainment; with the decode leg on the soonest peer it gained 3 on
  8:8-flex Mooncake but lost 22 on 8:8-flex shared-prefix, where a drained prompt is
  prefilled whole, shared prefix included, on an instance that also decodes);
* the remote path is slower and the local one may still meet the target: a drain
  only joins a longer queue. Measured on shared-prefix on 12:4 H200, where the first
  burst arrives before any reading: draining on the unread wait sent 104 of 400
  prompts to four prefillers in the first second, and 98 of 130 drained requests
  missed TTFT (75.5% at x5.66, against 99.5% with these conditions).

**spill**: a prefill pool may also serve whole requests (its ``spill`` setting: its
connector serves its own requests too). Then, before anything else, a request whose
decoder is *crowded* -- a decode step with one more stream than it holds, by the
hardware profile (each stream of the mean prompt and half the mean output; without a
profile, its pool's observed ITL), is past ``tpot * tpot_goal`` -- or *queued* (``wait
+ hop >= ttft * slack``) goes whole, at threshold 0, to the compatible spilling
prefiller that answers soonest (:meth:`GoodputPolicy.spill_target`): its queued
prompts counted whole, and the prompt less what it holds of it (the prefix index's
count for that prefiller when the planner has one, else its hit rate), at its rate.
The queue counts whole, an upper bound, because the prefiller decodes the requests
it serves whole while it prefills, which neither its rate nor its hit rate sees:
measured on shared-prefix with 1024 requests on 12:4 H200 at x9.51 (second draw),
the hit rate took the estimate of requests spilled to prefillers decoding 40-58
streams to 0.4-0.6 s where they waited 1.0-1.4 s, and 71 of 162 missed TTFT. A
prefiller takes it only when that answer is within the TTFT target, and either its
own step with one more stream is shorter than the decoder's or, for a queued
decoder, it answers before the decoder's queue would start the prompt; ties go to
the shorter step. The decision names it; the planner puts it first (reason ``spill``). Moving a
prefill P/D gives a crowded decoder back compute, not its streams: on shared-prefix
with 1024 requests on 8:8 H200 at x4 each decoder held about 128 streams (28.8 ms a
step before any prefill), where decode-only, with 16 instances decoding, held 64
(17.6 ms); at x4.76 the decoders were 81% busy and the prefillers 35%. With
spilling prefillers that row's goodput went from x4 to x8 (95.7% of requests within
the SLO at x8), and Mooncake's on 8:8 from x0.841 to x1.09. A spill costs the
decoder the warm prefix a P/D transfer would have left there: shared-prefix with 400
requests on 12:4 lost a step to it (benchmarks/README, "The spill matrix").
Without a spilling pool nothing here applies, and the decisions are the ones below.

**routed spill**: with a spilling pool the policy also reads where the decode routing
would send the request if the spilling prefillers were decoders too
(``reads_spill``): the planner ranks them beside the decoders, as a decode-only fleet
ranks every instance (decode-first only, and only for a request that names no
prefillers of its own). When that pick is a spilling prefiller, the policy decides
for it as for a decoder: if it would keep the prompt (its wait leaves room in its
share, and the prompt less what it holds is within what the TTFT and stall limits
keep there, whatever the threshold; with no other prefiller, whenever its wait
leaves room) it serves the request whole (threshold 0, reason ``spill``, counted in
its duty cycle). A pick whose queue spends its share, where a decoder would keep the
prompt (reason ``queued``), serves it whole only if its wait plus its prefill of the
prompt's uncached part still meets the TTFT target: declined, the prompt joins a
decoder's queue instead, as long or longer in a burst (measured over three draws: on
shared-prefix with 400 requests on 8:8 at x16, 96.4% of requests within the SLO
against 93.0% declining it, decode-only 86.9%; with 1024 on mixed at x13.5, 90.2%
against 88.4%; Mooncake on mixed, four windows at five rates, moved by -2.4 to +0.8
points). Otherwise -- a later answer, a drain, or a prompt it would send P/D -- the
policy answers 1 (reason ``declined``) and the planner ranks the decoders alone and
asks again for their pick. A pick that holds a long prompt (a re-asked document) thus
serves it, where the whole prompt's cost-model limit would have declined it to a
decoder that holds none of it.
This is what the crowded-or-queued rule lacked: the routing spreads a burst and its
prefixes over every instance that decodes from the first request, where that rule
moved a request only once its decoder was already crowded, to a prefiller that
mostly lacked its prefix. A prompt a prefiller would not take whole (a long uncached
prompt, a queue past the target) still goes decode-first to a decoder, so the prefill
pool stays free for P/D where P/D pays (Mooncake). Measured on shared-prefix with
1024 requests on 8:8 H200 at x9.51: 95.6% of requests within the SLO (decode-only
92.7%, the crowded-or-queued rule alone 84.9%); on Mooncake on 8:8 (four windows) at
x1.09: 76.3% (75.1% without). The pick's wait counts its queue at the larger of
its hit rate and the prompt's own cached share (the prefix index's): the routing
picked it for the prefix it holds, so its queue is mostly the prompt's neighbours,
while its reading also counts the cold prompts decoders spilled or drained to it.
On shared-prefix with 1024 requests on mixed at x13.5, one H200 prefiller read 0.52
while the prompts it was picked for held 86% of their tokens there: 160,000 queued
tokens were priced at 2.3 s, and it declined 64 of the 90 requests the routing
picked it for; the decoder that holds that prefix missed the SLO for 47 of the 55
requests of that prefix it served. With the own share: 88.4% within the SLO over
three draws (82.9% before, decode-only 88.7%); Mooncake (four windows, five rates
near its frontier, each fleet) moved by -1.5 to +2.4 points. Where the policy still
loses to decode-only, and why: benchmarks/README, "The current matrix".

A decoder whose wait leaves room in its share keeps ``u`` when ``u / rate_d`` is
within ``max(remote, ttft * slack - wait)`` (local costs the fleet less whenever it
still meets the target, even when remote would be a little faster) and -- when a
dedicated prefiller can take it and the wait and the remote path together are within
``ttft * slack``, so that the alternative is a sure one -- the stall fits. A
prefiller that also decodes is another decoder: a prompt sent there moves its
prefill to another decode queue and its stall to other streams, and adds a
transfer. So with only such prefillers the stall bound does not apply and the
decoder keeps ``u`` when ``u / rate_d`` is within ``ttft - wait``, or whenever the
remote path does not meet the target either. The largest such ``u`` is ``u*``, and
the policy sends ``t = 1 - (u* + 1/2) / L``: the decoder admits iff ``u <= u*``. No
compatible prefiller: 0.

Learning (``observe``): per decoder pool, the ITL (an EWMA) and two prefill rates
from the requests the gateway served, each sample ``tokens / (ttft - overhead)``,
the overhead including the attention term (for a P/D sample, the whole prompt's):
``rate_d`` from requests decoded where they were prefilled (``u`` from the usage's
cached tokens), ``rate_p`` from P/D requests (``L`` tokens). A rate estimate is a
decaying maximum, ``r <- max(s, r + alpha * (s - r))``: a fast sample (an idle
engine) lifts it at once, slow ones (queueing, which the wait terms already count)
pull it down only at ``alpha`` per sample, so it follows a changed engine without
chasing the load. A P/D sample counts the whole prompt (the gateway does not learn
what the prefiller had cached), so one more than twice the best rate the pool has
known (its seed, ``rate_d``) is taken for a prompt the prefiller held and is not
learnt: on long-doc, one re-asked document's 0.05 s prefill lifted ``rate_p`` to
700k tokens/s, and for the next 50 prompts the remote path looked 8-25 times faster
than it was (4.6 points of attainment lost at x1 on 12:4). Seeds: the hardware
profile's rate for the endpoint's hardware and model when the simulator knows it,
else ``prefill_tokens_per_s``; until the first ITL is observed, the bare step is
that profile's decode step for the decoder's streams (0 without a profile), and
afterwards that step stays a floor under the observed one. So it needs no profile on
real vLLM; without one the stall bound follows the pool's observed ITL alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Annotated, ClassVar

from pydantic import Field

from pd_orchestrator.model.endpoints import Endpoint
from pd_orchestrator.model.hardware import PROFILES, LatencyProfile
from pd_orchestrator.model.load import Candidate
from pd_orchestrator.policies.base import (
    POLICY,
    LatencyObservation,
    ThresholdContext,
    ThresholdDecision,
    clamp_ratio,
)
from pd_orchestrator.routing.interfaces import PluginContext
from pd_orchestrator.routing.registry import NoParams, PluginType

__all__ = [
    "GOODPUT",
    "DutyCycle",
    "GoodputParams",
    "GoodputPolicy",
    "PoolModel",
    "profile_of",
    "seed_rate",
]

_Positive = Annotated[float, Field(gt=0.0, allow_inf_nan=False)]


class GoodputParams(NoParams):
    """SLO targets ``ttft`` and ``tpot`` (seconds); ``slack``: the share of the TTFT
    target a local prefill may use when remote would be faster, the decoder wait
    from which it drains, and the share the remote path must fit in for the stall
    bound to apply; ``tpot_goal``: the share of ``tpot`` the mean stream is held to
    (module docstring, **stall**); the seeds
    ``prefill_tokens_per_s`` (when no hardware profile is known) and
    ``transfer_tokens_per_s`` (KV moved per second: 40 GB/s at 128 KiB a token);
    ``hop`` (one leg's one-way latency), ``out_mean`` (the seed of the mean output,
    tokens), ``alpha`` (learning rate); ``prefill_attention``: seconds a prefilled
    token spends on each token before it (the attention term of a prefill, module
    docstring, **prefill time**; None: the hardware profile's when one matches, else
    0, a linear model)."""

    ttft: _Positive = 1.0
    tpot: _Positive = 0.03
    slack: Annotated[float, Field(ge=0.0, le=1.0)] = 0.5
    prefill_tokens_per_s: _Positive = 20_000.0
    transfer_tokens_per_s: _Positive = 300_000.0
    hop: Annotated[float, Field(ge=0.0, allow_inf_nan=False)] = 0.002
    out_mean: _Positive = 256.0
    alpha: Annotated[float, Field(gt=0.0, le=1.0)] = 0.05
    tpot_goal: Annotated[float, Field(gt=0.0, le=1.0)] = 0.6
    prefill_attention: Annotated[float, Field(ge=0.0, allow_inf_nan=False)] | None = None


def profile_of(endpoint: Endpoint) -> LatencyProfile | None:
    """The hardware profile (the simulator's calibration) matching ``endpoint``'s
    hardware and model, if any."""
    for profile in PROFILES.values():
        if (profile.hardware, profile.model) == (endpoint.hardware, endpoint.model):
            return profile
    return None


def seed_rate(endpoint: Endpoint, default: float) -> float:
    """Prefill tokens per second of ``endpoint`` by its hardware profile when one
    matches its hardware and model, else ``default``."""
    profile = profile_of(endpoint)
    return 1.0 / profile.lin if profile is not None and profile.lin > 0 else default


def _mean(mean: float, sample: float, alpha: float) -> float:
    """An exponentially weighted mean; the first sample (``mean`` 0) is taken whole."""
    return sample if not mean else mean + alpha * (sample - mean)


def _learn_rate(rate: float, sample: float, alpha: float) -> float:
    """The decaying maximum of the module docstring."""
    return max(sample, rate + alpha * (sample - rate))


@dataclass(slots=True)
class PoolModel:
    """What the policy knows of one decoder pool: the local and remote prefill rates
    (tokens/s), the ITL observed there (seconds, None before any), the free chunk
    of its steps (tokens a step carries at no cost), its hardware profile, the
    rate both estimates were seeded with (0: none) and the attention term of its
    prefills (seconds a prefilled token spends on each token before it; 0: linear)."""

    rate_local: float
    rate_remote: float
    itl: float | None = None
    free_tokens: float = 150.0
    profile: LatencyProfile | None = None
    seed: float = 0.0
    attn: float = 0.0

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


@dataclass(slots=True)
class GoodputPolicy:
    """See the module docstring. Reasons: ``no-prefiller``, ``spill`` (served whole on
    a spilling prefiller), ``declined`` (a spilling prefiller the routing picked does
    not take the request whole; the planner asks again for a decoder), ``drain``,
    ``queued`` (a queued decoder that keeps the prompt: no dedicated prefiller, or no
    drain that pays), ``local`` (u* covers the whole prompt), ``cost-model`` (u* < L),
    ``stall`` (the stall bound set u*)."""

    params: GoodputParams = field(default_factory=GoodputParams)
    name: str = "goodput"
    reads_prefillers: ClassVar[bool] = True
    reads_peers: ClassVar[bool] = True
    reads_cache: ClassVar[bool] = True
    reads_spill: ClassVar[bool] = True
    bounds: ClassVar[tuple[float, float]] = (0.0, 1.0)
    pools: dict[str, PoolModel] = field(default_factory=dict)
    duty: dict[str, DutyCycle] = field(default_factory=dict)
    hits: dict[str, float] = field(default_factory=dict)
    prompt_mean: float = 0.0
    out_mean: float = 0.0

    def _pool(self, decoder: Endpoint) -> PoolModel:
        model = self.pools.get(decoder.pool)
        if model is None:
            rate = seed_rate(decoder, self.params.prefill_tokens_per_s)
            profile = profile_of(decoder)
            attn = self.params.prefill_attention
            if attn is None:
                attn = profile.attn if profile is not None else 0.0
            model = PoolModel(rate, rate, profile=profile, seed=rate, attn=attn)
            self.pools[decoder.pool] = model
        return model

    # -- the estimates (seconds) -------------------------------------------------------------
    def hit_rate(self, candidate: Candidate) -> float | None:
        """``candidate``'s prefix-cache hit rate: its reading's, else the last one a
        reading gave (a window with no prompt, or a stale or missed scrape, leaves the
        cache as it was); None when no reading ever gave one."""
        load = candidate.load
        rate = load.prefix_hit_rate if load is not None else None
        name = candidate.endpoint.name
        if rate is None:
            return self.hits.get(name)
        self.hits[name] = rate
        return rate

    def remote_ttft(self, context: ThresholdContext, model: PoolModel) -> float | None:
        """The expected TTFT through the best compatible prefiller (None: none)."""
        if not context.prefillers:
            return None
        tokens, p = context.prompt_tokens, self.params
        mean = self.prompt_mean or tokens
        prefill = min(self._remote_seconds(context, c, mean, model) for c in context.prefillers)
        return prefill + tokens / p.transfer_tokens_per_s + 3 * p.hop

    def _remote_seconds(
        self, context: ThresholdContext, prefiller: Candidate, mean: float, model: PoolModel
    ) -> float:
        """Seconds ``prefiller`` computes before this prompt's first token, at the
        pool's remote rate: its backlog or its request count (:func:`_outstanding`)
        times the ``mean`` prompt, the larger, less its hit rate (linear); then the
        prompt less what it holds of it (:meth:`_uncached_on`), with its attention
        (:meth:`PoolModel.prefill_seconds`). A prefiller that also decodes computes the
        whole prompt (its hit rate is its own conversations')."""
        hit = self.hit_rate(prefiller) or 0.0
        tokens, rate = context.prompt_tokens, model.rate_remote
        queued = max(prefiller.backlog, _outstanding(prefiller) * mean) * (1.0 - hit)
        own = (
            tokens
            if prefiller.endpoint.role.decodes
            else self._uncached_on(context, prefiller, hit)
        )
        return queued / rate + model.prefill_seconds(rate, own, tokens - own)

    def _uncached_on(self, context: ThresholdContext, prefiller: Candidate, hit: float) -> float:
        """The prompt's tokens ``prefiller`` lacks: less what the prefix index says it
        holds when the planner has one, else less its hit rate ``hit``."""
        tokens = context.prompt_tokens
        cached = context.cached_on(prefiller.endpoint) if context.cached_on else None
        return tokens * (1.0 - hit) if cached is None else tokens - min(cached, tokens)

    def local_wait(self, context: ThresholdContext, model: PoolModel) -> float:
        """Seconds of prefill queued at the decoder before this request's own."""
        hit = self.hit_rate(context.decoder) or 0.0
        return self._queued(context.decoder, context.prompt_tokens, model, hit)

    def _queued(self, decoder: Candidate, tokens: int, model: PoolModel, hit: float) -> float:
        """Seconds of prefill queued at ``decoder`` at hit rate ``hit`` (``tokens``: the
        prompt's, the mean prompt before one is learnt)."""
        load = decoder.load
        backlog: float = decoder.backlog
        if load is not None and load.waiting:
            backlog = max(backlog, load.waiting * (self.prompt_mean or tokens))
        return backlog * (1.0 - hit) / model.rate_local

    def soonest(self, context: ThresholdContext, wait: float) -> str | None:
        """The peer (:attr:`ThresholdContext.peers`) where a drained request's decode
        leg starts soonest: the least prefill queued there, ties to fewer requests in
        flight, then to the ranking's order; None when none beats the chosen decoder's
        ``wait``."""
        best: str | None = None
        key = (wait, context.decoder.in_flight)
        for peer in context.peers:
            model = self._pool(peer.endpoint)
            queued = self._queued(peer, context.prompt_tokens, model, self.hit_rate(peer) or 0.0)
            if (queued, peer.in_flight) < key:
                best, key = peer.endpoint.name, (queued, peer.in_flight)
        return best

    def output_tokens(self) -> float:
        """A stream's mean output in tokens: learnt, or the ``out_mean`` seed."""
        return self.out_mean or self.params.out_mean

    def window(self) -> float:
        """Seconds a stream decodes for within the TPOT target: the span over which
        local prefills land on the same streams (the duty cycle's window)."""
        return self.output_tokens() * self.params.tpot

    def local_share(self, context: ThresholdContext, model: PoolModel) -> float:
        """The share of the decoder's time its local prefills take: the uncached tokens
        this policy kept there over the last window, at its prefill rate."""
        duty = self.duty.get(context.decoder.endpoint.name)
        if duty is None:
            return 0.0
        window = self.window()
        return duty.decayed(context.now, window) / (window * model.rate_local)

    def stall_limit(self, context: ThresholdContext, model: PoolModel) -> float:
        """The most uncached tokens a local prefill may have before the streams
        decoding on the decoder miss the TPOT target (inf: nothing decodes there).

        A stream's time per output token is its decode step stretched by the share
        ``s`` of the decoder's time spent prefilling: ``itl / (1 - s)``. The observed
        ITL already carries the current share, so the bare step is ``itl * (1 - s)``,
        and the share the target allows is ``1 - step / (tpot * tpot_goal)``. The
        limit is what is left of that share over a window, in tokens, and never less
        than the tokens a step carries for free."""
        streams = _streams(context.decoder)
        if streams == 0:
            return math.inf
        share = self.local_share(context, model)
        step = self._bare_step(context, model, streams, share)
        allowed = 1.0 - step / (self.params.tpot * self.params.tpot_goal)
        room = (allowed - share) * self.window() * model.rate_local
        return max(model.free_tokens, room)

    def _bare_step(
        self, context: ThresholdContext, model: PoolModel, streams: int, share: float
    ) -> float:
        """A decode step without prefill at the decoder, with its ``streams`` now: the
        observed ITL less the prefill share, or the hardware profile's step for
        ``streams`` streams of the mean prompt (this one's before any) and half the
        mean output each, the larger (module docstring, **stall**); 0 with neither."""
        observed = 0.0 if model.itl is None else model.itl * (1.0 - min(share, _MAX_SHARE))
        if model.profile is None:
            return observed
        return max(observed, self._stream_step(model, context.prompt_tokens, streams))

    def _stream_step(self, model: PoolModel, prompt: int, streams: int) -> float:
        """A decode step with ``streams`` streams and no prefill: the hardware profile's
        (each stream of the mean prompt, ``prompt`` before one is learnt, and half the
        mean output), else the pool's observed ITL (0 before any)."""
        if model.profile is None:
            return model.itl or 0.0
        per_stream = (self.prompt_mean or prompt) + self.output_tokens() / 2
        return model.profile.step_seconds(round(streams * per_stream), streams, 0.0)

    def spill_target(
        self, context: ThresholdContext, model: PoolModel, wait: float, *, queued: bool
    ) -> str | None:
        """The prefiller that serves the request whole (module docstring, **spill**), or
        None: no healthy compatible prefiller spills, the decoder is neither crowded nor
        ``queued`` (its ``wait`` spends ``ttft * slack``), or none takes it sooner or
        with a shorter step within the TTFT target."""
        spills = [c for c in context.prefillers if c.endpoint.spill and c.healthy]
        if not spills:
            return None
        p, tokens = self.params, context.prompt_tokens
        step = self._stream_step(model, tokens, _streams(context.decoder) + 1)
        if not queued and step <= p.tpot * p.tpot_goal:
            return None
        best: tuple[tuple[float, float], str] | None = None
        for candidate in spills:
            pool = self._pool(candidate.endpoint)
            ttft = self._spilled_ttft(context, candidate, pool)
            if ttft + p.hop > p.ttft:
                continue
            own = self._stream_step(pool, tokens, _streams(candidate) + 1)
            if own < step or (queued and ttft < wait):
                key = (ttft, own)
                if best is None or key < best[0]:
                    best = (key, candidate.endpoint.name)
        return None if best is None else best[1]

    def _spilled_ttft(
        self, context: ThresholdContext, prefiller: Candidate, pool: PoolModel
    ) -> float:
        """Seconds before ``prefiller`` (of ``pool``) would answer the request served
        whole there: its queued prompts counted whole (an upper bound: it decodes the
        requests it serves whole meanwhile, which its hit rate does not see; module
        docstring, **spill**), then the prompt less what it holds of it (by the prefix
        index when the planner has one, else by its hit rate)."""
        tokens = context.prompt_tokens
        uncached = self._uncached_on(context, prefiller, self.hit_rate(prefiller) or 0.0)
        return self._queued(prefiller, tokens, pool, 0.0) + pool.local_seconds(uncached, tokens)

    def decide(self, context: ThresholdContext) -> ThresholdDecision:
        tokens = context.prompt_tokens
        if tokens <= 0:
            return ThresholdDecision(0.0, self.name, "local")
        decision, kept = self._decide(context)
        picked = context.decoder.endpoint
        if picked.spill:  # the routing's pick is a spilling prefiller (**routed spill**)
            if kept is None:
                return ThresholdDecision(1.0, self.name, "declined")
            decision = ThresholdDecision(0.0, self.name, "spill", decoder=picked.name)
        if kept is not None:
            self._keep(context, kept)
        return decision

    def _decide(self, context: ThresholdContext) -> tuple[ThresholdDecision, float | None]:
        """The decision for ``context``'s decoder, and the uncached tokens it keeps if it
        keeps the prompt (None: it does not); the caller counts them (:meth:`_keep`)."""
        tokens = context.prompt_tokens
        model = self._pool(context.decoder.endpoint)
        remote = self.remote_ttft(context, model)
        if remote is None:
            if not context.decoder.endpoint.spill:
                return ThresholdDecision(0.0, self.name, "no-prefiller"), None
            remote = math.inf  # a spilling pick with no other prefiller: no remote path
        p = self.params
        hit = self.hit_rate(context.decoder)
        cached = context.cached_tokens
        share = _queue_share(hit, cached, tokens, routed=context.decoder.endpoint.spill)
        uncached = tokens - cached if cached is not None else tokens * (1.0 - share)
        wait = self._queued(context.decoder, tokens, model, share)
        room = p.ttft * p.slack - wait - p.hop
        spill = self.spill_target(context, model, wait, queued=room <= 0.0)
        if spill is not None:
            return ThresholdDecision(0.0, self.name, "spill", decoder=spill), None
        dedicated = any(not c.endpoint.role.decodes for c in context.prefillers)
        if room <= 0.0:
            local = wait + model.local_seconds(uncached, tokens)
            known = hit is not None or cached is not None
            if dedicated and self._drains(local, remote, known=known):
                peer = self.soonest(context, wait)
                return ThresholdDecision(1.0, self.name, "drain", decoder=peer), None
            late = context.decoder.endpoint.spill and local + p.hop > p.ttft  # keeps none
            return ThresholdDecision(0.0, self.name, "queued"), None if late else uncached
        by_ttft = self._ttft_limit(model, tokens, wait, remote, dedicated)
        # a real alternative to a stall: a prefiller that does not decode, in time
        sure = dedicated and wait + remote <= p.ttft * p.slack
        by_stall = self.stall_limit(context, model) if sure else math.inf
        keep = min(by_ttft, by_stall)
        kept = uncached if uncached <= keep else None
        if keep >= tokens:
            return ThresholdDecision(0.0, self.name, "local"), kept
        reason = "stall" if by_stall < by_ttft else "cost-model"
        value = clamp_ratio(1.0 - (keep + 0.5) / tokens)
        return ThresholdDecision(value, self.name, reason), kept

    def _ttft_limit(
        self, model: PoolModel, tokens: int, wait: float, remote: float, dedicated: bool
    ) -> float:
        """The most uncached tokens the decoder keeps for the TTFT target. With a
        dedicated prefiller: what local prefill does within the remote path's time or
        within the slack share of the target, the longer. With only prefillers that
        also decode (another decoder's queue and streams, plus a transfer): what local
        prefill does within the whole target, and everything unless the remote path
        meets the target."""
        p = self.params
        if dedicated:
            seconds = max(remote - p.hop, p.ttft * p.slack - wait - p.hop)
            return model.tokens_within(seconds, tokens)
        if wait + remote > p.ttft:
            return math.inf
        return model.tokens_within(p.ttft - wait - p.hop, tokens)

    def _drains(self, local: float, remote: float, *, known: bool) -> bool:
        """Whether a queued decoder with a dedicated prefiller drains (module docstring):
        the remote path meets the target and is the faster one, or the ``local`` one
        misses the target anyway; on an unread hit rate (``known`` False, the wait an
        upper bound), only a faster remote path within ``ttft * slack``. When every
        compatible prefiller also decodes, the caller keeps the prompt without asking."""
        p = self.params
        if not known:
            return remote <= min(local, p.ttft * p.slack)
        return remote <= p.ttft and (remote <= local or local > p.ttft)

    def _keep(self, context: ThresholdContext, uncached: float) -> None:
        """Count ``uncached`` tokens the decoder keeps (the prompt less the decoder's hit
        rate) in its duty cycle."""
        name = context.decoder.endpoint.name
        duty = self.duty.get(name)
        if duty is None:
            duty = self.duty[name] = DutyCycle()
        duty.add(context.now, uncached, self.window())

    # -- learning ----------------------------------------------------------------------------
    def observe(self, observation: LatencyObservation) -> None:
        model = self.pools.get(observation.pool)
        if model is None:
            return
        alpha = self.params.alpha
        if observation.itl is not None:
            model.itl = _mean(model.itl or 0.0, observation.itl, alpha)
        if observation.prompt_tokens:
            self.prompt_mean = _mean(self.prompt_mean, observation.prompt_tokens, alpha)
        if observation.output_tokens:
            self.out_mean = _mean(self.out_mean, observation.output_tokens, alpha)
        self._learn_rates(observation, model)

    def _learn_rates(self, observation: LatencyObservation, model: PoolModel) -> None:
        ttft, tokens = observation.ttft, observation.prompt_tokens
        if ttft is None or not tokens or observation.remote is None:
            return
        p = self.params
        if observation.remote:
            spent = ttft - tokens / p.transfer_tokens_per_s - 4 * p.hop
            spent -= model.attention_seconds(tokens, 0.0)
            if tokens >= _MIN_SAMPLE and spent > 0 and tokens / spent <= _plausible(model):
                model.rate_remote = _learn_rate(model.rate_remote, tokens / spent, p.alpha)
            return
        if observation.cached_tokens is None:
            return
        uncached = tokens - observation.cached_tokens
        spent = ttft - 2 * p.hop - model.attention_seconds(uncached, observation.cached_tokens)
        if uncached >= _MIN_SAMPLE and spent > 0:
            model.rate_local = _learn_rate(model.rate_local, uncached / spent, p.alpha)


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

_MIN_SAMPLE = 512
"""Prompt tokens below which a TTFT says more about fixed costs than about a rate."""


def _queue_share(hit: float | None, cached: int | None, tokens: int, *, routed: bool) -> float:
    """The cached share of the prompts queued at the decoder: its reading's hit rate;
    before any reading, this prompt's own cached share (the prefix index's), else 0
    (every queued prompt uncached, an upper bound). At a spilling prefiller the
    routing picked (``routed``, module docstring, **routed spill**), the larger of the
    two: the routing picked it for the prefix it holds, so its queue is mostly this
    prompt's neighbours, while its reading also counts the cold prompts decoders
    spilled or drained to it."""
    own = cached / tokens if cached is not None and tokens > 0 else None
    if hit is None:
        return 0.0 if own is None else own
    if routed and own is not None:
        return max(hit, own)
    return hit


def _streams(candidate: Candidate) -> int:
    """Requests running at an endpoint: the gateway's own count or a reading, the
    larger."""
    load = candidate.load
    return max(candidate.in_flight, load.running if load is not None else 0)


def _outstanding(candidate: Candidate) -> int:
    """Requests at a prefiller: the gateway's own count or a reading, the larger."""
    load = candidate.load
    if load is None:
        return candidate.in_flight
    return max(candidate.in_flight, load.running + load.waiting)


def _goodput(params: GoodputParams, context: PluginContext) -> GoodputPolicy:
    return GoodputPolicy(params, context.name)


GOODPUT = PluginType("goodput", POLICY, GoodputParams, _goodput)
