"""Measuring running vLLM-compatible endpoints for ``pd-orchestrator profile``.

Every request goes through the project's upstream client
(:class:`~pd_orchestrator.upstream.client.Upstream`) to ``/v1/completions`` with the
prompt as token ids (exact lengths; each prompt starts with fresh random ids, so a
cold one shares no block with any other), streamed, ``ignore_eos``, temperature 0.
What is measured (the fit: :mod:`pd_orchestrator.model.measured`):

1. **cold prefill**: a lone prompt of each length, ``max_tokens`` 1: its time to the
   first token;
2. **cached share**: a prompt sent once, then again with its first ``share`` kept and
   the rest fresh: new tokens after cached ones (the decoder's reported
   ``prompt_tokens_details.cached_tokens`` when it reports them; else the kept part,
   rounded down to whole blocks);
3. **decode step**: ``batch`` streams of a ``context``-token prompt started together:
   the median gap between their tokens once all decode (``repeats`` runs a setting,
   as for every phase);
4. **mixed step**: streams decoding when a cold prompt arrives: the gap of each stream
   that ends with the prompt's first token (the step that prefilled it);
5. **hand-over** (with a prefiller; after one not recorded, which pays a fresh pair's
   handshake): a cold prompt through the gateway's P/D shape (the
   connector's prefill leg on the prefiller, its decode leg on the decoder: the
   legs' order, bodies and headers as :mod:`pd_orchestrator.flows.handover` sends
   them), the decode leg's time to its first token less that of the same prompt sent
   again to the decoder alone (then cached there). A hand-over the pair answers with
   an error is skipped and counted (``source["failed_handovers"]``).

Bounded: at most ``max_requests`` requests and ``max_seconds`` seconds (a phase that
would pass either stops; what was measured is fitted).
"""

from __future__ import annotations

import itertools
import logging
import random
import statistics
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any
from urllib.parse import urlsplit

import anyio

from connectors import Connector, LegOrder, PeerInfo, TransferContext, get_connector
from connectors import Leg as Side
from pd_orchestrator.config.settings import TimeoutConfig, UpstreamConfig
from pd_orchestrator.model.endpoints import Endpoint, Role
from pd_orchestrator.model.measured import (
    MixedPoint,
    Points,
    PrefillPoint,
    StepPoint,
    TransferPoint,
)
from pd_orchestrator.model.records import record
from pd_orchestrator.openai.sse import chunk_tokens
from pd_orchestrator.policies.calibration import COLD_TOKEN_IDS
from pd_orchestrator.upstream.client import Phase, Upstream
from pd_orchestrator.upstream.errors import UpstreamError

__all__ = ["Budget", "ProfileOptions", "Profiler", "cache_capacity"]

Json = dict[str, Any]
_PATH = "/v1/completions"
_log = logging.getLogger(__name__)


@record
class ProfileOptions:
    """What to measure and the bounds (module docstring). ``token_ids``: the range
    prompt ids are drawn from (within any model's vocabulary); ``block_size``: the
    decoder's KV block (a cached count rounds down to it when not reported);
    ``seed``: of the prompts (None: a fresh one, so that a second run's cold prompts
    are not the first run's, cached on the server)."""

    url: str
    prefiller_url: str | None = None
    connector: str = "nixl"
    model: str | None = None
    api_key: str | None = None
    lengths: tuple[int, ...] = (256, 1024, 2048, 4096)
    shares: tuple[float, ...] = (0.5, 0.9)
    batches: tuple[int, ...] = (1, 4, 16)
    contexts: tuple[int, ...] = (256, 2048)
    output_tokens: int = 24
    mixed_chunk: int = 2048
    repeats: int = 3
    max_requests: int = 400
    max_seconds: float = 600.0
    token_ids: tuple[int, int] = COLD_TOKEN_IDS
    block_size: int = 16
    seed: int | None = None

    def within(self, max_model_len: int | None) -> ProfileOptions:
        """These options with every prompt short enough for a server of
        ``max_model_len`` tokens (its output included; None: as they are)."""
        if max_model_len is None:
            return self
        longest = max(max_model_len - max(64, 4 * self.output_tokens) - 1, 1)
        return replace(
            self,
            lengths=tuple(n for n in self.lengths if n <= longest) or (longest,),
            contexts=tuple(n for n in self.contexts if n <= longest) or (longest,),
            mixed_chunk=min(self.mixed_chunk, longest),
        )

    def planned(self) -> int:
        """Requests the full plan sends (the progress bar's total, before the bounds)."""
        cold = len(self.lengths) * self.repeats
        cached = len(self.lengths) * len(self.shares) * self.repeats * 2
        decode = sum(self.batches) * len(self.contexts) * self.repeats
        mixed = (max(self.batches) + 1) * self.repeats
        handover = 3 * len(self.lengths) * self.repeats if self.prefiller_url else 0
        return min(cold + cached + decode + mixed + handover, self.max_requests)


@dataclass(slots=True)
class Budget:
    """The bounds: requests left and a deadline on ``clock``."""

    requests: int
    deadline: float
    clock: Callable[[], float] = time.monotonic
    sent: int = 0

    def take(self, count: int = 1) -> bool:
        """Whether ``count`` more requests fit (then counted as sent)."""
        if self.sent + count > self.requests or self.clock() >= self.deadline:
            return False
        self.sent += count
        return True


def _endpoint(name: str, url: str, role: Role, connector: str, api_key: str | None) -> Endpoint:
    return Endpoint(
        name=name,
        url=url.rstrip("/"),
        role=role,
        connector=connector,
        authorization=None if api_key is None else f"Bearer {api_key}",
    )


def cache_capacity(metrics: str) -> int | None:
    """KV capacity in tokens from vLLM's ``vllm:cache_config_info`` gauge
    (``num_gpu_blocks`` x ``block_size``), None when it is not exported."""
    for line in metrics.splitlines():
        if not line.startswith("vllm:cache_config_info{"):
            continue
        labels = dict(
            part.split("=", 1) for part in line[line.index("{") + 1 : line.rindex("}")].split(",")
        )
        try:
            blocks = int(labels.get("num_gpu_blocks", "").strip('"'))
            size = int(labels.get("block_size", "").strip('"'))
        except ValueError:
            return None
        return blocks * size
    return None


@dataclass(slots=True)
class Profiler:
    """Runs the measurements of :class:`ProfileOptions` (:meth:`run`); ``advance``
    is told of each request sent and the phase it belongs to (a progress bar)."""

    options: ProfileOptions
    advance: Callable[[str], None] = lambda phase: None
    upstream: Upstream = field(init=False)
    decoder: Endpoint = field(init=False)
    prefiller: Endpoint | None = field(init=False)
    connector: Connector = field(init=False)
    budget: Budget = field(init=False)
    model: str = field(init=False, default="")
    reports_cached: bool | None = field(init=False, default=None)
    failed_handovers: int = field(init=False, default=0)
    _random: random.Random = field(init=False)

    def __post_init__(self) -> None:
        o = self.options
        self.upstream = Upstream(UpstreamConfig(), TimeoutConfig(decode=600.0, prefill=600.0))
        self.decoder = _endpoint("decoder", o.url, Role.DECODE, o.connector, o.api_key)
        self.prefiller = (
            None
            if o.prefiller_url is None
            else _endpoint("prefiller", o.prefiller_url, Role.PREFILL, o.connector, o.api_key)
        )
        self.connector = get_connector(o.connector)
        self.budget = Budget(o.max_requests, time.monotonic() + o.max_seconds)
        self._random = random.Random(o.seed)

    async def run(self) -> tuple[Points, Json]:
        """Every phase within the bounds: the points and what was measured (``source``)."""
        try:
            model, max_len = await self._served_model()
            self.model = self.options.model or model
            self.options = self.options.within(max_len)
            capacity = await self._capacity()
            prefill = await self._cold() + await self._cached()
            decode = await self._decode()
            mixed = await self._mixed()
            handover = await self._handover() if self.prefiller is not None else []
        finally:
            await self.upstream.aclose()
        o = self.options
        source: Json = {
            "url": o.url,
            "prefiller_url": o.prefiller_url,
            "connector": o.connector if o.prefiller_url else None,
            "model": self.model,
            "requests": self.budget.sent,
            "capacity_tokens": capacity,
            "reports_cached_tokens": self.reports_cached,
            "failed_handovers": self.failed_handovers,
            "lengths": list(o.lengths),
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        points = Points(tuple(prefill), tuple(decode), tuple(mixed), tuple(handover))
        return points, source

    # -- plumbing ---------------------------------------------------------------------------
    async def _served_model(self) -> tuple[str, int | None]:
        """The first model ``/v1/models`` names and its ``max_model_len`` (None: not
        said)."""
        name, length = await self.upstream.served_model(self.decoder, limit=30.0)
        if name is None:
            raise RuntimeError(f"{self.options.url}/v1/models names no model (give --model)")
        return name, length

    async def _capacity(self) -> int | None:
        reply = await self.upstream.get(self.decoder, "/metrics", limit=30.0)
        return cache_capacity(reply.text) if reply.status_code == 200 else None

    def _fresh(self, count: int) -> list[int]:
        low, high = self.options.token_ids
        return [self._random.randrange(low, high) for _ in range(count)]

    def _body(self, prompt: list[int], max_tokens: int) -> Json:
        return {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "min_tokens": max_tokens,
            "ignore_eos": True,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "return_token_ids": True,
        }

    async def _times(
        self, endpoint: Endpoint, body: Json, *, headers: dict[str, str] | None = None
    ) -> tuple[float, list[float], int | None]:
        """Send ``body`` streamed: when it was sent, when each piece of content came
        (monotonic seconds) and the reported cached count (None: not reported)."""
        started = time.monotonic()
        stream = await self.upstream.open_stream(
            endpoint, _PATH, body, phase=Phase.DECODE, headers=headers
        )
        times: list[float] = []
        cached: int | None = None
        try:
            async for chunks in stream:
                now = time.monotonic()
                for chunk in chunks:
                    if chunk_tokens(chunk):
                        times.append(now)
                    usage = chunk.get("usage")
                    if usage:
                        details = usage.get("prompt_tokens_details") or {}
                        found = details.get("cached_tokens")
                        cached = found if isinstance(found, int) else cached
        finally:
            await stream.aclose()
        if self.reports_cached is None or cached is not None:
            self.reports_cached = cached is not None
        return started, times, cached

    async def _ttft(self, endpoint: Endpoint, prompt: list[int]) -> tuple[float, int | None]:
        started, times, cached = await self._times(endpoint, self._body(prompt, 1))
        if not times:
            raise RuntimeError(f"{endpoint.url} answered no token")
        return times[0] - started, cached

    def _step(self, phase: str, count: int = 1) -> bool:
        if not self.budget.take(count):
            return False
        for _ in range(count):
            self.advance(phase)
        return True

    # -- the phases --------------------------------------------------------------------------
    async def _cold(self) -> list[PrefillPoint]:
        points: list[PrefillPoint] = []
        if self._step("warm-up"):  # the first request of a fresh server is slow
            await self._ttft(self.decoder, self._fresh(max(self.options.lengths)))
        for _ in range(self.options.repeats):
            for length in self.options.lengths:
                if not self._step("cold prefill"):
                    return points
                seconds, cached = await self._ttft(self.decoder, self._fresh(length))
                held = cached or 0
                points.append(PrefillPoint(length - held, held, seconds))
        return points

    async def _cached(self) -> list[PrefillPoint]:
        points: list[PrefillPoint] = []
        o = self.options
        for _ in range(o.repeats):
            for length in o.lengths:
                for share in o.shares:
                    if not self._step("cached prefill", 2):
                        return points
                    base = self._fresh(length)
                    await self._ttft(self.decoder, base)
                    kept = int(length * share)
                    seconds, cached = await self._ttft(
                        self.decoder, base[:kept] + self._fresh(length - kept)
                    )
                    held = cached if cached is not None else kept // o.block_size * o.block_size
                    points.append(PrefillPoint(length - held, held, seconds))
        return points

    async def _streams(
        self, batch: int, context: int, tokens: int
    ) -> list[tuple[float, list[float], int | None]]:
        results: list[tuple[float, list[float], int | None]] = []

        async def one() -> None:
            results.append(
                await self._times(self.decoder, self._body(self._fresh(context), tokens))
            )

        async with anyio.create_task_group() as tg:
            for _ in range(batch):
                tg.start_soon(one)
        return results

    async def _decode(self) -> list[StepPoint]:
        """``repeats`` rounds over every (context, batch) setting, one run each a round
        (rounds, not runs back to back, so a slow spell of the host lands on several
        settings rather than on every sample of one)."""
        points: list[StepPoint] = []
        o = self.options
        for _ in range(o.repeats):
            for context in o.contexts:
                for batch in o.batches:
                    if not self._step("decode steps", batch):
                        return points
                    results = await self._streams(batch, context, o.output_tokens)
                    gap = _steady_gap([times for _, times, _ in results])
                    if gap is not None:
                        middle = context + o.output_tokens // 2
                        points.append(StepPoint(batch, batch * middle, gap))
        return points

    async def _mixed(self) -> list[MixedPoint]:
        points: list[MixedPoint] = []
        o = self.options
        batch, context = max(o.batches), min(o.contexts)
        tokens = max(64, 4 * o.output_tokens)
        for _ in range(o.repeats):
            if not self._step("mixed steps", batch + 1):
                return points
            found = await self._mixed_once(batch, context, tokens)
            if found is not None:
                points.append(found)
        return points

    async def _mixed_once(self, batch: int, context: int, tokens: int) -> MixedPoint | None:
        """``batch`` streams; once each has 3 tokens, a cold prompt of ``mixed_chunk``
        tokens: the median over streams of the step that carried it (:func:`_mixed_gap`)."""
        chunk = self.options.mixed_chunk
        streams: list[list[float]] = []
        first: list[tuple[float, float]] = []
        decoding = anyio.Event()

        async def one() -> None:
            times: list[float] = []
            streams.append(times)
            body = self._body(self._fresh(context), tokens)
            stream = await self.upstream.open_stream(self.decoder, _PATH, body, phase=Phase.DECODE)
            try:
                async for chunks in stream:
                    now = time.monotonic()
                    times.extend(now for chunk in chunks if chunk_tokens(chunk))
                    if len(streams) == batch and all(len(t) >= 3 for t in streams):
                        decoding.set()
            finally:
                await stream.aclose()
                decoding.set()  # a stream that ended early: measure what there is

        async def cold() -> None:
            await decoding.wait()
            sent, times, _ = await self._times(self.decoder, self._body(self._fresh(chunk), 1))
            first.extend((sent, t) for t in times[:1])

        async with anyio.create_task_group() as tg:
            for _ in range(batch):
                tg.start_soon(one)
            tg.start_soon(cold)
        if not first:
            return None
        sent, at = first[0]
        gaps = [g for times in streams if (g := _mixed_gap(times, sent, at)) is not None]
        if not gaps:
            return None
        done = statistics.median(sum(1 for t in times if t < at) for times in streams)
        return MixedPoint(batch, round(batch * (context + done)), chunk, statistics.median(gaps))

    async def _handover(self) -> list[TransferPoint]:
        """``repeats`` rounds over the lengths, after one hand-over not recorded: a
        fresh pair's first pays one-time costs (the connector's handshake)."""
        points: list[TransferPoint] = []
        if self._step("hand-over warm-up", 3):
            await self._handover_once(min(self.options.lengths))
        for _ in range(self.options.repeats):
            for length in self.options.lengths:
                if not self._step("hand-over", 3):
                    return points
                found = await self._handover_once(length)
                if found is not None:
                    points.append(found)
        return points

    async def _handover_once(self, length: int) -> TransferPoint | None:
        """One hand-over sample of a cold ``length``-token prompt; None when the pair
        answered it with an error (a connector may fail one hand-over now and then: the
        sample is lost, not the profile; counted in :attr:`failed_handovers`)."""
        prompt = self._fresh(length)
        try:
            leg = await self._pd_first_token(prompt)
        except UpstreamError as exc:
            self.failed_handovers += 1
            _log.warning("profile: a hand-over of %d tokens failed (%s); skipped", length, exc)
            return None
        await self._ttft(self.decoder, prompt)  # the hand-over's blocks settle
        warm, _ = await self._ttft(self.decoder, prompt)
        return TransferPoint(length, max(leg - warm, 0.0))

    async def _pd_first_token(self, prompt: list[int]) -> float:
        """One P/D request (the gateway's shape); seconds from the prefill's answer
        (for legs sent together; for sequential legs, from the decode leg's send) to
        the decode leg's first token."""
        prefiller = self.prefiller
        assert prefiller is not None
        connector = self.connector
        ctx = TransferContext(
            request_id=f"profile-{uuid.uuid4().hex}",
            transfer_id=uuid.uuid4().hex,
            prefiller=_peer(prefiller.url),
            decoder=_peer(self.decoder.url),
        )
        for lookup in connector.lookups(ctx):
            peer = prefiller if lookup.leg is Side.PREFILL else self.decoder
            ctx = ctx.with_peer(
                lookup.leg, lookup.parse(await self.upstream.get_json(peer, lookup.url))
            )
        body = self._body(prompt, 1)
        if connector.order(ctx) is LegOrder.TOGETHER:
            return await self._together(prefiller, ctx, body)
        answer = await self.upstream.post_json(
            prefiller,
            _PATH,
            connector.prefill_body(body, ctx),
            phase=Phase.PREFILL,
            headers=connector.headers(Side.PREFILL, ctx),
        )
        params = connector.read_prefill(answer, ctx).params
        started, times, _ = await self._times(
            self.decoder,
            connector.decode_body(body, params, ctx),
            headers=connector.headers(Side.DECODE, ctx),
        )
        return (times[0] if times else time.monotonic()) - started

    async def _together(self, prefiller: Endpoint, ctx: TransferContext, body: Json) -> float:
        connector = self.connector
        answered: list[float] = []
        decoded: list[tuple[float, list[float], int | None]] = []

        async def decode() -> None:
            decoded.append(
                await self._times(
                    self.decoder,
                    connector.decode_body(body, connector.ahead_params(ctx), ctx),
                    headers=connector.headers(Side.DECODE, ctx),
                )
            )

        async with anyio.create_task_group() as tg:
            tg.start_soon(decode)
            await self.upstream.post_json(
                prefiller,
                _PATH,
                connector.prefill_body(body, ctx),
                phase=Phase.PREFILL,
                headers=connector.headers(Side.PREFILL, ctx),
            )
            answered.append(time.monotonic())
        times = decoded[0][1] if decoded else []
        return (times[0] if times else time.monotonic()) - answered[0]


def _peer(url: str) -> PeerInfo:
    return PeerInfo(host=urlsplit(url).hostname or "127.0.0.1")


def _steady_gap(streams: list[list[float]]) -> float | None:
    """The step while all ``streams`` decode (after the last one's second token, before
    the first one's last): each stream's mean gap there, the median over streams
    (a mean, as tokens read together show one long gap and one of 0)."""
    if not streams or any(len(t) < 4 for t in streams):
        return None
    start = max(t[1] for t in streams)
    end = min(t[-1] for t in streams)
    means = []
    for times in streams:
        inside = [t for t in times if start <= t <= end]
        if len(inside) >= 2:
            means.append((inside[-1] - inside[0]) / (len(inside) - 1))
    return statistics.median(means) if means else None


def _mixed_gap(times: list[float], sent: float, at: float) -> float | None:
    """The longest gap of ``times`` that ends while a cold prompt sent at ``sent`` is
    prefilled (up to its first token at ``at``, and a little after: tokens of one
    step may be read late): the step that carried the prompt (None: no such gap)."""
    until = at + 0.005 + 0.1 * (at - sent)
    gaps = [b - a for a, b in itertools.pairwise(times) if sent < b <= until]
    return max(gaps) if gaps else None
