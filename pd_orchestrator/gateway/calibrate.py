"""Timing the pools the ``goodput`` policy knows nothing of, once the gateway starts.

The policy says which endpoints to time and at which lengths
(:mod:`~pd_orchestrator.policies.calibration`: one endpoint of each pool with no
profile that has learnt no local rate); this module sends the prompts and tells the
policy what they took. Each prompt is a fresh cold one (random token ids within any
model's vocabulary, as the profiler sends), ``max_tokens`` 1 (the decode step
prompts: ``probe_step_tokens``, EOS ignored, streamed with their token ids, the gaps
between their tokens timed as they come), to ``/v1/completions``,
timed from its send to its answer, with the cached count the answer reports (0 where
it reports none: no block of a fresh prompt can be held, so unlike a client's prompt
an unreported count is known). Every prompt goes after the one before has been
answered, one endpoint after another: a prompt timed while another probe runs beside
it (on the same host, the same link) would time that too; on the CPU pair, timed at
once, the decoder's and the prefiller's prompts read a quarter and three fifths
slow. Whether a prompt was timed alone is read from the endpoint as a reading taken
after the last prompt's answer shows it (:func:`_seen_after`). Lengths beyond the
model's ``max_model_len`` (``/v1/models``) are left out, and none is sent once the
probe's ``seconds`` (``probe_seconds``) have passed.

Requests are served meanwhile, on the seeds until the first answer is learnt, and
see each prompt in flight at its endpoint as they see one another. An endpoint that
fails (an error, or twice the probe's ``seconds`` gone) is left to learn from
traffic, with a warning; nothing else waits on it. It runs when the gateway starts
and after a reload (a pool a reload adds has learnt nothing), each gateway process
for itself.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import anyio

from pd_orchestrator.gateway.state import GatewayState
from pd_orchestrator.model.endpoints import Endpoint
from pd_orchestrator.model.load import Candidate
from pd_orchestrator.openai.sse import chunk_tokens
from pd_orchestrator.planner.plan import alone_at, queued_at
from pd_orchestrator.policies.calibration import COLD_TOKEN_IDS, Probe, Timed
from pd_orchestrator.policies.threshold import ThresholdResolver
from pd_orchestrator.upstream.client import Phase, Upstream
from pd_orchestrator.upstream.errors import UpstreamError

__all__ = ["calibrate", "planned"]

logger = logging.getLogger(__name__)

_HARD_BOUND = 2.0
"""A probe's prompts are sent within its ``seconds``; the one under way when they end
may take as long again, then it is cut (the upstream request closed: vLLM aborts it)."""


def planned(state: GatewayState, clock: Callable[[], float]) -> list[Probe]:
    """The probes ``state``'s threshold policies ask for, on the endpoints of its fleet
    as its load poller last read them; each probed pool is marked ``timing`` in
    :attr:`GatewayState.timing` (``/status``'s ``goodput_timing``) until it ends."""
    resolver = state.planner.threshold
    if resolver is None:
        return []
    probes = resolver.probes(state.scraper.candidates(state.fleet.snapshot(), clock()))
    for probe in probes:
        state.timing[probe.endpoint.pool] = f"timing on {probe.endpoint.name}"
    return probes


async def calibrate(
    state: GatewayState, upstream: Upstream, clock: Callable[[], float], probes: list[Probe]
) -> None:
    """Time ``probes`` (:func:`planned`), one endpoint after another."""
    resolver = state.planner.threshold
    if resolver is None:
        return
    for probe in probes:
        await _time_probe(state, upstream, clock, resolver, probe)
        # the probe's prompts missed every block: no hit rate of theirs is the traffic's
        await state.scraper.rebase(probe.endpoint)
        resolver.calibrated(probe.endpoint.name)


async def _time_probe(
    state: GatewayState,
    upstream: Upstream,
    clock: Callable[[], float],
    resolver: ThresholdResolver,
    probe: Probe,
) -> None:
    """One endpoint's probe: its prompts sent within its ``seconds``, the whole cut
    after twice that (:data:`_HARD_BOUND`); a failure is logged."""
    endpoint = probe.endpoint
    timed = 0
    with anyio.move_on_after(probe.seconds * _HARD_BOUND) as bound:
        try:
            model, longest = await _served(upstream, probe)
            rng = random.Random()
            started = clock()
            answered: float | None = None  # the last prompt's answer
            for length, output in probe.prompts(longest):
                if clock() - started >= probe.seconds:
                    break
                prompt = [rng.randrange(*COLD_TOKEN_IDS) for _ in range(length)]
                seen = await _seen_after(state, endpoint, answered, clock)
                timing = await _time_one(state, upstream, clock, seen, model, prompt, output)
                answered = clock()
                resolver.calibrate(probe, timing)
                timed += 1
        except UpstreamError as exc:
            state.timing[endpoint.pool] = f"failed on {endpoint.name} after {_prompts(timed)}"
            logger.warning(
                "goodput: timing pool %s on %s failed (%s); it learns from traffic",
                endpoint.pool, endpoint.name, exc,
            )  # fmt: skip
            return
    if bound.cancelled_caught:
        logger.warning(
            "goodput: timing pool %s on %s took over %.0f s; it learns from traffic",
            endpoint.pool, endpoint.name, probe.seconds * _HARD_BOUND,
        )  # fmt: skip
    state.timing[endpoint.pool] = f"timed on {endpoint.name}: {_prompts(timed)}"
    logger.info(
        "goodput: pool %s timed on %s (%d cold prompts): %s",
        endpoint.pool, endpoint.name, timed, _rates(resolver, probe),
    )  # fmt: skip


async def _served(upstream: Upstream, probe: Probe) -> tuple[str, int | None]:
    """The model to name (the endpoint's, else the first ``/v1/models`` lists) and the
    longest prompt that leaves room for one output token (None: not said)."""
    listed, longest = await upstream.served_model(probe.endpoint, limit=10.0)
    name = probe.endpoint.model or listed
    if name is None:
        raise UpstreamError(probe.endpoint.name, Phase.PROBE, "/v1/models names no model")
    return name, longest - 1 if longest is not None and longest > 1 else None


async def _seen_after(
    state: GatewayState, endpoint: Endpoint, answered: float | None, clock: Callable[[], float]
) -> Candidate:
    """``endpoint`` as the gateway's counts and a reading taken at ``answered`` or after
    show it (``answered``: the probe's last answer; None: no prompt before, any reading
    stands). Where the poller's last reading is older, the endpoint is polled once more;
    where that gives none, the candidate holds no reading. A reading taken while the
    last prompt ran shows it there: running, which the reading's ``counted`` tells
    apart from another's (:attr:`Candidate.others`), or still waiting, which it does
    not (:func:`queued_at`); on the CPU pair, read once a second, two or three of the
    eight prompts on a server were judged timed beside another before either."""
    seen = _seen(state, endpoint, clock())
    if answered is None or _read_after(seen, answered):
        return seen
    await state.scraper.poll(endpoint)
    seen = _seen(state, endpoint, clock())
    return seen if _read_after(seen, answered) else replace(seen, load=None)


def _seen(state: GatewayState, endpoint: Endpoint, now: float) -> Candidate:
    """``endpoint`` as the gateway's counts and the poller's fresh reading show it."""
    (seen,) = state.scraper.candidates([state.fleet.status_of(endpoint.name)], now)
    return seen


def _read_after(seen: Candidate, answered: float) -> bool:
    """Whether ``seen`` holds a reading taken at ``answered`` or after."""
    return seen.load is not None and seen.load.observed_at >= answered


async def _time_one(
    state: GatewayState,
    upstream: Upstream,
    clock: Callable[[], float],
    seen: Candidate,
    model: str,
    prompt: list[int],
    output: int,
) -> Timed:
    """Send one cold prompt for ``output`` tokens (EOS ignored) to the endpoint ``seen``
    names and time it; whether it was queued or alone at its send, as ``seen`` (the
    load poller and the gateway's counts: :func:`_seen_after`) saw the endpoint. While
    it is out it counts in flight there, its tokens queued, so that requests planned
    meanwhile see it."""
    endpoint = seen.endpoint
    queued = queued_at(seen)
    body = {
        "model": model, "prompt": prompt, "max_tokens": output, "temperature": 0.0,
        "ignore_eos": True,
    }  # fmt: skip
    gap: float | None = None
    state.fleet.enter(endpoint.name, len(prompt))  # counted as a request is
    try:
        sent = clock()
        if output > 1:
            usage, gap = await _streamed(upstream, endpoint, body, len(prompt), clock)
        else:
            answer = await upstream.post_json(
                endpoint, "/v1/completions", body, phase=Phase.PREFILL, prompt_tokens=len(prompt)
            )
            usage = answer.get("usage")
        seconds = clock() - sent
    finally:
        state.fleet.leave(endpoint.name, len(prompt))
    usage = usage if isinstance(usage, dict) else {}
    tokens = usage.get("prompt_tokens")
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    generated = usage.get("completion_tokens")
    return Timed(
        tokens if isinstance(tokens, int) and tokens > 0 else len(prompt),
        cached if isinstance(cached, int) and cached >= 0 else 0,  # fresh ids: none held
        max(0.0, seconds),
        queued=queued,
        alone=alone_at(seen, queued),
        output=generated if isinstance(generated, int) and generated > 0 else output,
        gap=gap,
    )


async def _streamed(
    upstream: Upstream,
    endpoint: Endpoint,
    body: dict[str, Any],
    prompt_tokens: int,
    clock: Callable[[], float],
) -> tuple[object, float | None]:
    """Stream the decode step prompt ``body``: its usage (None: not sent) and the mean
    time between its tokens after the first, from the first token's arrival to the
    last's over the tokens between (counted by their ids, else one a chunk; None:
    fewer than two tokens came apart)."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True},
            "return_token_ids": True}  # fmt: skip
    stream = await upstream.open_stream(
        endpoint, "/v1/completions", body, phase=Phase.PREFILL, prompt_tokens=prompt_tokens
    )
    usage: object = None
    first: float | None = None
    last, after = 0.0, 0  # the last token's arrival; the tokens after the first chunk's
    try:
        async for chunks in stream:
            now = clock()
            for chunk in chunks:
                usage = chunk.get("usage") or usage
                count = chunk_tokens(chunk)
                if count and first is None:
                    first = now
                elif count:
                    last, after = now, after + count
    finally:
        await stream.aclose()
    return usage, (last - first) / after if first is not None and after else None


def _prompts(count: int) -> str:
    return f"{count} prompt" if count == 1 else f"{count} prompts"


def _rates(resolver: ThresholdResolver, probe: Probe) -> str:
    """What the policies learnt of the probed pools, in words."""
    pools = [probe.endpoint.pool, *(d.pool for d in probe.decoders)]
    words = []
    for name, learnt in resolver.learnt().items():
        for pool in pools:
            rates = learnt.get(pool)
            if rates is not None:
                words.append(
                    f"{name} {pool} local {rates['rate_local']:.0f} tokens/s, "
                    f"remote {rates['rate_remote']:.0f} tokens/s, "
                    f"fixed {(rates['prefill_fixed'] or 0.0) * 1e3:.1f} ms a prefill"
                )
    return "; ".join(words) or "nothing learnt"
