"""A closed-loop HTTP load generator for OpenAI-compatible servers.

``concurrency`` workers each send one request at a time until ``total`` requests
were sent. Every request yields a :class:`Sample` (status, latency, time to the
first streamed token, the gateway's decision header). :func:`summarize` turns
samples into percentiles and a request rate.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import httpx

from pd_orchestrator.model.records import record

__all__ = ["Sample", "Summary", "percentile", "run_closed_loop", "send", "summarize"]

Body = dict[str, Any]


@record
class Sample:
    """One request's outcome."""

    status: int
    latency: float
    ttft: float | None
    decision: str | None
    text: str
    usage: dict[str, Any] | None


@record
class Summary:
    count: int
    errors: int
    rps: float
    p50: float
    p99: float
    ttft_p50: float | None
    ttft_p99: float | None


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) by linear interpolation; 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _text(choice: dict[str, Any]) -> str:
    if "text" in choice:
        return str(choice.get("text") or "")
    part = choice.get("delta") or choice.get("message") or {}
    return str(part.get("content") or "")


async def send(client: httpx.AsyncClient, path: str, body: Body) -> Sample:
    """Send one request (streamed when ``body["stream"]``) and time it."""
    started = time.perf_counter()
    if not body.get("stream"):
        response = await client.post(path, json=body)
        latency = time.perf_counter() - started
        data = response.json() if response.status_code == 200 else {}
        text = _text((data.get("choices") or [{}])[0]) if data else ""
        return Sample(
            response.status_code,
            latency,
            None,
            response.headers.get("x-pd-decision"),
            text,
            data.get("usage"),
        )
    ttft: float | None = None
    pieces: list[str] = []
    usage = None
    async with client.stream("POST", path, json=body) as response:
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or []:
                piece = _text(choice)
                if piece and ttft is None:
                    ttft = time.perf_counter() - started
                pieces.append(piece)
        decision = response.headers.get("x-pd-decision")
        status = response.status_code
    return Sample(status, time.perf_counter() - started, ttft, decision, "".join(pieces), usage)


async def run_closed_loop(
    base_url: str,
    path: str,
    make_body: Callable[[int], Body],
    *,
    total: int,
    concurrency: int,
    warmup: int = 1,
) -> tuple[list[Sample], float]:
    """Send ``total`` requests with ``concurrency`` workers; returns samples and wall time.

    Each worker has its own client (one connection): a single httpx pool serving
    many concurrent requests costs CPU that grows with their number, and the load
    generator must not be the bottleneck it measures. Every worker first sends
    ``warmup`` untimed requests (connection set-up); timing starts when all are done.
    """
    samples: list[Sample] = []
    counter = iter(range(total))
    ready = 0
    all_ready = anyio.Event()

    async def worker() -> None:
        nonlocal ready
        async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
            for index in range(warmup):
                await send(client, path, make_body(total + index))
            ready += 1
            if ready == concurrency:
                all_ready.set()
            await all_ready.wait()
            for index in counter:
                samples.append(await send(client, path, make_body(index)))

    started = 0.0

    async def start_clock() -> None:
        nonlocal started
        await all_ready.wait()
        started = time.perf_counter()

    async with anyio.create_task_group() as tg:
        tg.start_soon(start_clock)
        for _ in range(concurrency):
            tg.start_soon(worker)
    return samples, time.perf_counter() - started


def summarize(samples: Sequence[Sample], wall: float) -> Summary:
    ok = [s for s in samples if s.status == 200]
    latencies = [s.latency for s in ok]
    ttfts = [s.ttft for s in ok if s.ttft is not None]
    return Summary(
        count=len(samples),
        errors=len(samples) - len(ok),
        rps=len(ok) / wall if wall > 0 else 0.0,
        p50=percentile(latencies, 50),
        p99=percentile(latencies, 99),
        ttft_p50=statistics.median(ttfts) if ttfts else None,
        ttft_p99=percentile(ttfts, 99) if ttfts else None,
    )
