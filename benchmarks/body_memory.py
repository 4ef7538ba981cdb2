"""The gateway's memory for requests with several choices of a large body.

Starts two simulators (a decoder and a prefiller, ``instant`` profile) and a gateway
on free loopback ports, then sends ``--requests`` completion requests of a
``--mib`` MiB body with ``n`` = ``--n`` choices, ``--concurrency`` at a time, each
a different prompt (cold: choice 0 goes through P/D, the others are admitted warm).
The body's bulk is an extra field (``metadata``) that every leg carries as it is,
so the simulators' context length does not bound the size. It prints the
gateway's resident memory before (``VmRSS``) and its peak (``VmHWM``) after, and
the peak's growth; everything started is stopped.

    .venv/bin/python benchmarks/body_memory.py [--mib 1.9] [--n 16] [--requests 8]
        [--concurrency 4]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import uuid
from pathlib import Path

import httpx
import yaml

from pd_orchestrator.children import Child, python_command, start_child, stop_child

MODEL = "sim-model"


def _status_kib(child: Child, field: str) -> int:
    """A ``/proc/<pid>/status`` figure of ``child`` in KiB (``VmRSS``, ``VmHWM``)."""
    for line in Path(f"/proc/{child.process.pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not found")


async def _drive(url: str, mib: float, n: int, requests: int, concurrency: int) -> None:
    limit = asyncio.Semaphore(concurrency)
    words = int(mib * 1024 * 1024 / 6)

    async def one(client: httpx.AsyncClient) -> None:
        prompt = f"{uuid.uuid4().hex} " + "hello " * 64
        body = {"model": MODEL, "prompt": prompt, "n": n, "max_tokens": 4, "seed": 1,
                "metadata": {"notes": "note " * words}}  # fmt: skip
        async with limit:
            response = await client.post("/v1/completions", json=body)
        if response.status_code != 200:
            raise RuntimeError(f"{response.status_code}: {response.text[:300]}")

    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        await asyncio.gather(*(one(client) for _ in range(requests)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=float, default=1.9)
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=4)
    args = parser.parse_args()
    sim = ("sim", "--host", "127.0.0.1", "--port", "0", "--profile", "instant")
    children: list[Child] = []
    try:
        for name in ("decoder", "prefiller"):
            children.append(start_child(name, python_command(*sim, "--kv-connector", "nixl")))
        decoder, prefiller = children
        config = {
            "decoders": [{"name": "d0", "url": decoder.url, "model": MODEL}],
            "prefillers": [{"name": "p0", "url": prefiller.url, "model": MODEL}],
        }
        with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as file:
            yaml.safe_dump(config, file)
        gateway = start_child(
            "gateway", python_command("serve", "--config", file.name, "--port", "0")
        )
        children.append(gateway)
        asyncio.run(_drive(gateway.url, args.mib, args.n, 1, 1))  # warm up imports, pools
        before = _status_kib(gateway, "VmRSS")
        asyncio.run(_drive(gateway.url, args.mib, args.n, args.requests, args.concurrency))
        peak = _status_kib(gateway, "VmHWM")
        print(
            f"body {args.mib} MiB, n={args.n}, {args.requests} requests, "
            f"{args.concurrency} at a time: RSS before {before / 1024:.0f} MiB, "
            f"peak {peak / 1024:.0f} MiB, growth {(peak - before) / 1024:.0f} MiB"
        )
    finally:
        for child in reversed(children):
            stop_child(child)


if __name__ == "__main__":
    main()
