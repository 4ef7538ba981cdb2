"""The gateway's own work per request, in one process, without an HTTP server.

The overhead benchmark (``overhead_bench.py``) measures a relay as its clients see
it; this script takes the HTTP server away to see what is left. It starts the
minimal backend (``minimal_backend.py``), builds the gateway
(:class:`~pd_orchestrator.gateway.app.Gateway`, the overhead benchmark's config) or
one of the floor relay's ASGI apps (``floor_relay.py``: ``floor-asgi``, the same
upstream client and nothing else; ``floor-decode``, the least a decode-first
gateway does; ``floor-plan``, that with the gateway's own admission, plan and
learning), and calls the ASGI app directly from ``--concurrency`` loops, each sending
the overhead benchmark's request one after another (an in-memory ``receive`` and
``send``; the request's connection offers the gateway's disconnect hook, as its
protocol does). It prints the CPU time this process spent per request (the backend
runs in its own process) and, with ``--profile``, cProfile's top functions by own
time and the Python and builtin calls per request (each resumption of a coroutine
counts as a call). Run each target pinned to one CPU (``taskset -c 1``) and compare
targets run one after the other: on a shared machine one run moves by a third.

    .venv/bin/python benchmarks/request_path.py
        [--target gateway|floor-asgi|floor-decode|floor-plan] [--stream]
        [--requests 8000] [--concurrency 16] [--profile [--dump FILE]]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import pstats
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import uvloop

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import floor_relay  # noqa: E402
import overhead_bench  # noqa: E402

from pd_orchestrator.config.loader import parse_config  # noqa: E402
from pd_orchestrator.gateway.app import Gateway  # noqa: E402
from pd_orchestrator.gateway.protocol import DISCONNECTS, Disconnects  # noqa: E402

App = Callable[[dict[str, Any], Any, Any], Awaitable[None]]
WARM_UP = 50
"""Requests per loop before the measured ones (pools filled, first-use paths taken)."""


def scope_of(body: bytes) -> dict[str, Any]:
    """The ASGI scope uvicorn gives the overhead benchmark's request."""
    headers = [(b"host", b"127.0.0.1"), (b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]  # fmt: skip
    return {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
        "query_string": b"", "root_path": "", "headers": headers,
        "client": ("127.0.0.1", 40000), "server": ("127.0.0.1", 8000),
        "extensions": {DISCONNECTS: {"connection": Disconnects()}},
    }  # fmt: skip


async def one(app: App, body: bytes) -> None:
    """One request through ``app``; fails unless it is answered 200."""
    received = False
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        nonlocal received
        if received:  # the client never goes: wait for ever
            await asyncio.Event().wait()
        received = True
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app(scope_of(body), receive, send)
    if not sent or sent[0].get("status") != 200:
        raise RuntimeError(f"the request was not answered 200: {sent[:2]}")


def build(target: str, backend_url: str) -> tuple[App, Callable[[], Awaitable[None]]]:
    """The ASGI app of ``target`` in front of the backend, and how to close its upstream
    connections."""
    if target == "gateway":
        gateway = Gateway(parse_config(overhead_bench.gateway_config(backend_url)))
        return gateway.app(), gateway.upstream.aclose  # type: ignore[return-value]
    upstream = floor_relay.Upstream(backend_url)
    app = floor_relay.app_of(target.removeprefix("floor-"), upstream, backend_url)
    return app, upstream.transport.aclose


async def measure(args: argparse.Namespace, backend_url: str) -> None:
    app, close = build(args.target, backend_url)
    body = overhead_bench.request_body(args.stream, overhead_bench.PROMPT).encode()
    loops = args.concurrency

    async def loop(count: int) -> None:
        for _ in range(count):
            await one(app, body)

    await asyncio.gather(*(loop(WARM_UP) for _ in range(loops)))
    gc.collect()
    gc.freeze()  # as `serve` does after start-up
    gc.set_threshold(50_000, 50, 100)
    each = max(1, args.requests // loops)
    profile = cProfile.Profile() if args.profile else None
    started = time.process_time()
    if profile is not None:
        profile.enable()
    await asyncio.gather(*(loop(each) for _ in range(loops)))
    if profile is not None:
        profile.disable()
    spent = time.process_time() - started
    await close()
    total = each * loops
    mode = "stream" if args.stream else "whole"
    print(f"{args.target} {mode}: {total} requests, CPU {spent / total * 1e6:.1f} us/req")
    if profile is not None:
        stats = pstats.Stats(profile)
        calls = sum(entry[1] for entry in stats.stats.values())  # type: ignore[attr-defined]
        print(f"calls per request (profiled): {calls / total:.0f}")
        stats.sort_stats("tottime").print_stats(args.top)
        if args.dump is not None:
            stats.dump_stats(args.dump)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument(
        "--target",
        choices=("gateway", "floor-asgi", "floor-decode", "floor-plan"),
        default="gateway",
    )
    parser.add_argument("--stream", action="store_true", help="streamed answers")
    parser.add_argument("--requests", type=int, default=8000)
    parser.add_argument("--concurrency", type=int, default=16, help="loops sending at once")
    parser.add_argument("--profile", action="store_true", help="cProfile the measured requests")
    parser.add_argument("--top", type=int, default=30, help="functions the profile lists")
    parser.add_argument("--dump", type=Path, help="with --profile: write the pstats file here")
    args = parser.parse_args(argv)
    if args.requests < 1 or args.concurrency < 1:
        parser.error("--requests and --concurrency must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    with ExitStack() as stack:
        backend = overhead_bench.start_backend(stack)
        uvloop.run(measure(args, backend.url))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
