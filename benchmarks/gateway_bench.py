"""Gateway overhead against the simulator, and a multi-turn chat replay on the demo setup."""

from __future__ import annotations

import argparse
import statistics
import sys
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import anyio
import httpx
import yaml

sys.path.insert(0, str(Path(__file__).parent))

from _common import console, ms, sim, summary_table
from rich.table import Table

from pd_orchestrator.bench.loadgen import Sample, run_closed_loop, send, summarize
from pd_orchestrator.children import python_command, start_child, stop_child

MODEL = "sim-model"
ROOT = Path(__file__).resolve().parents[1]


async def overhead(gateway: str, decoder: str, total: int, concurrency: int) -> None:
    prompts = [f"warm prompt {i} " + "with a shared history. " * 6 for i in range(concurrency)]

    def body(i: int) -> dict[str, Any]:
        return {
            "model": MODEL,
            "prompt": prompts[i % len(prompts)],
            "max_tokens": 16,
            "ignore_eos": True,
        }

    async with httpx.AsyncClient(base_url=gateway, timeout=30) as client:
        for i in range(len(prompts)):  # P/D once: every prompt is then cached on its decoder
            await send(client, "/v1/completions", body(i))
    rows = []
    for name, url in (
        ("direct", decoder),
        ("gateway", gateway),
        ("direct#2", decoder),
        ("gateway#2", gateway),
    ):
        samples, wall = await run_closed_loop(
            url, "/v1/completions", body, total=total, concurrency=concurrency
        )
        decisions = Counter(s.decision for s in samples)
        if name.startswith("gateway"):
            assert set(decisions) == {"decode"}, decisions
        rows.append((name, summarize(samples, wall)))
    console.print(
        summary_table(
            f"non-streaming 16-token requests, instant profile, concurrency {concurrency}", rows
        )
    )
    direct = [s for n, s in rows if n.startswith("direct")]
    through = [s for n, s in rows if n.startswith("gateway")]
    for label, attr in (("p50", "p50"), ("p99", "p99"), ("req/s", "rps")):
        d = statistics.mean(getattr(s, attr) for s in direct)
        g = statistics.mean(getattr(s, attr) for s in through)
        console.print(f"  gateway/direct {label}: {g / d:.2f}  ({g:.4g} vs {d:.4g})")


def _conversation_bodies(turns: int) -> list[str]:
    return [
        f"Question {t}: " + "please explain the next step in detail. " * 4 for t in range(turns)
    ]


async def replay(url: str, model: str, conversations: int, turns: int) -> None:
    system = "You are a helpful assistant for a long-running project. " * 25
    results: list[tuple[int, Sample]] = []

    async def conversation(index: int) -> None:
        messages = [{"role": "system", "content": system}]
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            for turn, question in enumerate(_conversation_bodies(turns)):
                messages.append(
                    {"role": "user", "content": f"[{index}-{uuid.uuid4().hex[:6]}] {question}"}
                )
                body = {"model": model, "messages": messages, "max_tokens": 64, "stream": True}
                sample = await send(client, "/v1/chat/completions", body)
                results.append((turn, sample))
                messages.append({"role": "assistant", "content": sample.text})

    async with anyio.create_task_group() as tg:
        for index in range(conversations):
            tg.start_soon(conversation, index)
    table = Table(title=f"{conversations} conversations x {turns} turns through configs/local.yaml")
    for column in ("turns", "requests", "decode", "pd", "errors", "ttft p50 ms", "ttft p99 ms"):
        table.add_column(column, justify="right")
    groups = {"1": [s for t, s in results if t == 0], "2+": [s for t, s in results if t > 0]}
    groups["all"] = [s for _, s in results]
    for name, samples in groups.items():
        decisions = Counter(s.decision for s in samples)
        ttfts = sorted(s.ttft for s in samples if s.ttft is not None)
        table.add_row(
            name, str(len(samples)), str(decisions["decode"]), str(decisions["pd"]),
            str(sum(s.status != 200 for s in samples)),
            ms(statistics.median(ttfts)), ms(ttfts[int(0.99 * (len(ttfts) - 1))]),
        )  # fmt: skip
    console.print(table)
    by_decision = {
        d: ms(statistics.median([s.ttft for _, s in results if s.decision == d and s.ttft]))
        for d in ("decode", "pd")
    }
    console.print(f"  TTFT p50 by decision: {by_decision}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--total", type=int, default=3000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--conversations", type=int, default=20)
    parser.add_argument("--turns", type=int, default=6)
    args = parser.parse_args()
    nixl = ("--profile", "instant", "--kv-connector", "nixl")
    with sim(*nixl, name="decoder") as decoder, sim(*nixl, name="prefiller") as prefiller:
        config = {
            "decoders": [{"name": "decode-0", "url": decoder.url, "model": MODEL}],
            "prefillers": [{"name": "prefill-0", "url": prefiller.url, "model": MODEL}],
            "threshold": {"policy": {"value": 0.5}},
        }
        path = Path(f"/tmp/pdo-bench-{uuid.uuid4().hex[:8]}.yaml")
        path.write_text(yaml.safe_dump(config))
        gateway = start_child(
            "gateway", python_command("serve", "--config", str(path), "--port", "0")
        )
        try:
            anyio.run(overhead, gateway.url, decoder.url, args.total, args.concurrency)
        finally:
            stop_child(gateway)
            path.unlink()
    if args.conversations <= 0:
        return
    demo = start_child(
        "up",
        python_command("up", "--config", str(ROOT / "configs/local.yaml"), "--port", "0"),
        timeout=60,
    )
    try:
        anyio.run(
            replay, demo.url, "meta-llama/Llama-3.1-8B-Instruct", args.conversations, args.turns
        )
    finally:
        stop_child(demo)


if __name__ == "__main__":
    main()
