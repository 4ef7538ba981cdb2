"""``goodput``: a cost model in seconds -- prefill where the request meets its SLO at
the least cost to everyone else.

For the chosen decoder and a prompt of ``L`` tokens, ``u`` of them uncached there:

* **wait** at the decoder: the prompt tokens queued there before this one (its
  *backlog*: the gateway's own requests sent there that have had no first answer
  yet, or what a reading's ``waiting`` counts times the mean prompt, the larger: a
  reading carries what other gateways sent), less its prefix-cache hit rate, over its
  prefill rate. Both paths pay it: the decode attempt is admitted or rejected only
  when the decoder's scheduler reaches it.
* **remote** (P/D), beyond that wait: the best compatible prefiller's backlog and the
  prompt itself, less that prefiller's hit rate, at its rate, the KV transfer and the
  extra legs::

      remote = min over p of (backlog_p + L) * (1 - hit_p) / rate_p
               + L / transfer_rate + 3 * hop

* **local**, beyond that wait: ``u / rate_d``.
* **stall**: what a local prefill of ``u`` tokens costs the ``B`` streams decoding
  there. Steps are memory-bound until compute catches up (a roofline), so the first
  ``free`` tokens of each step ride free; beyond, the prefill's time lands on every
  stream in those steps. Spread over a stream's ``out_mean`` output tokens it raises
  its time per output token by ``stall(u) / out_mean``, against the room
  ``tpot - itl_d`` left under the TPOT target (``itl_d``: the pool's observed ITL).

A decoder whose wait already spends its share of the TTFT target (``wait + hop >=
ttft * slack``) keeps nothing: the policy sends threshold 1, which no prompt meets,
so the gateway skips the decode attempt (and its wait in that queue) and the
request goes P/D at once; the queue drains (reason ``drain``). Otherwise it keeps
``u`` when ``u / rate_d`` is within ``max(remote, ttft * slack - wait)`` (local costs
the fleet less whenever it still meets the target, even when remote would be a
little faster) and -- when the wait and the remote path together meet the TTFT
target, so that there is a real alternative -- the stall fits. The largest such
``u`` is ``u*``, and the policy sends ``t = 1 - (u* + 1/2) / L``: the decoder admits
iff ``u <= u*``. No compatible prefiller: 0.

Learning (``observe``): per decoder pool, the ITL (an EWMA) and two prefill rates
from the requests the gateway served, each sample ``tokens / (ttft - overhead)``:
``rate_d`` from requests decoded where they were prefilled (``u`` from the usage's
cached tokens), ``rate_p`` from P/D requests (``L`` tokens). A rate estimate is a
decaying maximum, ``r <- max(s, r + alpha * (s - r))``: a fast sample (an idle
engine) lifts it at once, slow ones (queueing, which the wait terms already count)
pull it down only at ``alpha`` per sample, so it follows a changed engine without
chasing the load. Seeds: the hardware profile's rate for the endpoint's hardware and
model when the simulator knows it, else ``prefill_tokens_per_s``; so it needs no
profile on real vLLM.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Annotated, ClassVar

from pydantic import Field

from pd_orchestrator.model.endpoints import Endpoint
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

__all__ = ["GOODPUT", "GoodputParams", "GoodputPolicy", "PoolModel", "seed_rate"]

_Positive = Annotated[float, Field(gt=0.0, allow_inf_nan=False)]


class GoodputParams(NoParams):
    """SLO targets ``ttft`` and ``tpot`` (seconds); ``slack``: the share of the TTFT
    target a local prefill may use when remote would be faster, and the decoder wait
    from which it drains; the seeds
    ``prefill_tokens_per_s`` (when no hardware profile is known) and
    ``transfer_tokens_per_s`` (KV moved per second: 40 GB/s at 128 KiB a token);
    ``hop`` (one leg's one-way latency), ``out_mean`` (the seed of the mean output,
    tokens), ``alpha`` (learning rate)."""

    ttft: _Positive = 1.0
    tpot: _Positive = 0.03
    slack: Annotated[float, Field(ge=0.0, le=1.0)] = 0.5
    prefill_tokens_per_s: _Positive = 20_000.0
    transfer_tokens_per_s: _Positive = 300_000.0
    hop: Annotated[float, Field(ge=0.0, allow_inf_nan=False)] = 0.002
    out_mean: _Positive = 256.0
    alpha: Annotated[float, Field(gt=0.0, le=1.0)] = 0.05


def seed_rate(endpoint: Endpoint, default: float) -> float:
    """Prefill tokens per second of ``endpoint`` by its hardware profile (the
    simulator's calibration) when one matches its hardware and model, else ``default``."""
    from pd_orchestrator.model.hardware import PROFILES

    for profile in PROFILES.values():
        if (profile.hardware, profile.model) == (endpoint.hardware, endpoint.model):
            return 1.0 / profile.lin if profile.lin > 0 else default
    return default


def _mean(mean: float, sample: float, alpha: float) -> float:
    """An exponentially weighted mean; the first sample (``mean`` 0) is taken whole."""
    return sample if not mean else mean + alpha * (sample - mean)


def _learn_rate(rate: float, sample: float, alpha: float) -> float:
    """The decaying maximum of the module docstring."""
    return max(sample, rate + alpha * (sample - rate))


@dataclass(slots=True)
class PoolModel:
    """What the policy knows of one decoder pool: the local and remote prefill rates
    (tokens/s), the ITL observed there (seconds, None before any) and the free chunk
    of its steps (tokens a step carries at no cost)."""

    rate_local: float
    rate_remote: float
    itl: float | None = None
    free_tokens: float = 150.0


@dataclass(slots=True)
class GoodputPolicy:
    """See the module docstring. Reasons: ``no-prefiller``, ``drain``, ``local``
    (u* covers the whole prompt), ``cost-model`` (u* < L), ``stall`` (the stall bound
    set u*)."""

    params: GoodputParams = field(default_factory=GoodputParams)
    name: str = "goodput"
    reads_prefillers: ClassVar[bool] = True
    bounds: ClassVar[tuple[float, float]] = (0.0, 1.0)
    pools: dict[str, PoolModel] = field(default_factory=dict)
    prompt_mean: float = 0.0
    out_mean: float = 0.0

    def _pool(self, decoder: Endpoint) -> PoolModel:
        model = self.pools.get(decoder.pool)
        if model is None:
            rate = seed_rate(decoder, self.params.prefill_tokens_per_s)
            model = self.pools[decoder.pool] = PoolModel(rate, rate)
        return model

    # -- the estimates (seconds) -------------------------------------------------------------
    def remote_ttft(self, context: ThresholdContext, model: PoolModel) -> float | None:
        """The expected TTFT through the best compatible prefiller (None: none)."""
        if not context.prefillers:
            return None
        tokens, p = context.prompt_tokens, self.params
        mean = self.prompt_mean or tokens
        prefill = min(_remote_tokens(c, tokens, mean) for c in context.prefillers)
        return prefill / model.rate_remote + tokens / p.transfer_tokens_per_s + 3 * p.hop

    def local_wait(self, context: ThresholdContext, model: PoolModel) -> float:
        """Seconds of prefill queued at the decoder before this request's own."""
        load = context.decoder_load
        hit = _hit_rate(context.decoder)
        backlog: float = context.decoder.backlog
        if load is not None and load.waiting:
            backlog = max(backlog, load.waiting * (self.prompt_mean or context.prompt_tokens))
        return backlog * (1.0 - hit) / model.rate_local

    def stall_limit(self, context: ThresholdContext, model: PoolModel) -> float:
        """The most uncached tokens a local prefill may have before the streams
        decoding on the decoder miss the TPOT target (inf: nothing decodes there)."""
        load = context.decoder_load
        streams = max(context.decoder_in_flight, load.running if load is not None else 0)
        if streams == 0:
            return math.inf
        room = self.params.tpot - (model.itl or 0.0)
        if room <= 0.0:
            return 0.0
        out = self.out_mean or self.params.out_mean
        return room * out * model.rate_local + model.free_tokens

    def decide(self, context: ThresholdContext) -> ThresholdDecision:
        tokens = context.prompt_tokens
        if tokens <= 0:
            return ThresholdDecision(0.0, self.name, "local")
        model = self._pool(context.decoder.endpoint)
        remote = self.remote_ttft(context, model)
        if remote is None:
            return ThresholdDecision(0.0, self.name, "no-prefiller")
        p = self.params
        wait = self.local_wait(context, model)
        room = p.ttft * p.slack - wait - p.hop
        if room <= 0.0:
            return ThresholdDecision(1.0, self.name, "drain")
        by_ttft = max(remote - p.hop, room) * model.rate_local
        by_stall = self.stall_limit(context, model) if wait + remote <= p.ttft else math.inf
        keep = min(by_ttft, by_stall)
        if keep >= tokens:
            return ThresholdDecision(0.0, self.name, "local")
        reason = "stall" if by_stall < by_ttft else "cost-model"
        return ThresholdDecision(clamp_ratio(1.0 - (keep + 0.5) / tokens), self.name, reason)

    # -- learning ----------------------------------------------------------------------------
    def observe(self, observation: LatencyObservation) -> None:
        model = self.pools.get(observation.pool)
        if model is None:
            return
        alpha = self.params.alpha
        if observation.itl is not None:
            model.itl = _mean(model.itl or 0.0, observation.itl, alpha)
        tokens = observation.prompt_tokens
        if tokens:
            self.prompt_mean = tokens if not self.prompt_mean else (
                self.prompt_mean + alpha * (tokens - self.prompt_mean)
            )  # fmt: skip
        if observation.output_tokens:
            out = observation.output_tokens
            self.out_mean = (
                out if not self.out_mean else self.out_mean + alpha * (out - self.out_mean)
            )
        self._learn_rates(observation, model)

    def _learn_rates(self, observation: LatencyObservation, model: PoolModel) -> None:
        ttft, tokens = observation.ttft, observation.prompt_tokens
        if ttft is None or not tokens or observation.remote is None:
            return
        p = self.params
        if observation.remote:
            spent = ttft - tokens / p.transfer_tokens_per_s - 4 * p.hop
            if tokens >= _MIN_SAMPLE and spent > 0:
                model.rate_remote = _learn_rate(model.rate_remote, tokens / spent, p.alpha)
            return
        if observation.cached_tokens is None:
            return
        uncached = tokens - observation.cached_tokens
        spent = ttft - 2 * p.hop
        if uncached >= _MIN_SAMPLE and spent > 0:
            model.rate_local = _learn_rate(model.rate_local, uncached / spent, p.alpha)


_MIN_SAMPLE = 512
"""Prompt tokens below which a TTFT says more about fixed costs than about a rate."""


def _remote_tokens(candidate: Candidate, tokens: int, mean: float) -> float:
    """Prompt tokens a prefiller computes before this one's first token, this one's
    included: its backlog or its request count (:func:`_outstanding`) times the mean
    prompt, the larger, and ``tokens``; less its prefix-cache hit rate."""
    queued = max(candidate.backlog, _outstanding(candidate) * mean)
    return (queued + tokens) * (1.0 - _hit_rate(candidate))


def _hit_rate(candidate: Candidate) -> float:
    """The prefix-cache hit rate of ``candidate``'s reading (0 when unknown)."""
    load = candidate.load
    return (load.prefix_hit_rate if load is not None else None) or 0.0


def _outstanding(candidate: Candidate) -> int:
    """Requests at a prefiller: the gateway's own count or a reading, the larger."""
    load = candidate.load
    if load is None:
        return candidate.in_flight
    return max(candidate.in_flight, load.running + load.waiting)


def _goodput(params: GoodputParams, context: PluginContext) -> GoodputPolicy:
    return GoodputPolicy(params, context.name)


GOODPUT = PluginType("goodput", POLICY, GoodputParams, _goodput)
